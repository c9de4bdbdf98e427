"""The DiT's feed-forward gate in quack-kernels' fused GEMM (kernels/glu_linear.py) against cuBLAS plus the gate
pass, and flash-attn-4's SM90 attention against ours: one layer at 1, 2, 4 and 8 windows (time and error against
float64), then the whole fused bf16 call with the fused gate on and off, in alternating rounds, and a song's
precision against float32 with each.

    PYTHONPATH=src:<site-packages with quack-kernels and flash-attn-4> python3 bench/dit_glu.py
"""

from __future__ import annotations

import functools
import time
import traceback
from dataclasses import replace

import torch
import torch.nn.functional as F

from music3serve.acoustic.precision import float32_matmuls
from music3serve.bench.acoustic import PEAK_TFLOPS, dit_call, dit_flops, fused_bf16_dit
from music3serve.bench.common import graphed, interleaved_ms, table
from music3serve.bench.precision import rel_err
from music3serve.kernels import glu_linear as glu_module
from music3serve.kernels.dit_attention import dit_attention
from music3serve.kernels.glu_linear import glu, pair_rows, quack_gated_gemm

TOKENS, WIDTH, FF, HEADS = 690, 2048, 8192, 32  # a window's 689 latent columns and the time token
TILES = [(128, 128, True, 2), (128, 192, True, 2), (128, 128, True, 1), (256, 128, False, 2)]


def section(name: str, fn) -> None:
    print(f"\n## {name}", flush=True)
    start = time.time()
    try:
        fn()
    except Exception:  # one failing section must not hide the others
        traceback.print_exc()
    print(f"({name}: {time.time() - start:.0f} s)", flush=True)


@torch.inference_mode()
def glu_layer() -> None:
    gen = torch.Generator("cuda").manual_seed(0)
    w = pair_rows((torch.randn(2 * FF, WIDTH, device="cuda", generator=gen) * WIDTH**-0.5).bfloat16())
    b = pair_rows((torch.randn(2 * FF, device="cuda", generator=gen) * 0.1).bfloat16())
    ops = torch.compile(lambda h: glu(F.linear(h, w, b), pairs=True))
    rows = []
    for windows in (1, 2, 4, 8):
        h = torch.randn(2 * windows * TOKENS, WIDTH, device="cuda", generator=gen).bfloat16()
        exact = glu(F.linear(h.double(), w.double(), b.double()), pairs=True)
        fns = {"cuBLAS + inductor gate pass": lambda: ops(h)}
        for tile in TILES:
            tm, tn, pingpong, cm = tile
            name = f"quack {tm}x{tn} {'ping-pong' if pingpong else 'cooperative'}, cluster {cm}"
            fns[name] = functools.partial(quack_gated_gemm, h, w, b, tile)
        errors = {name: rel_err(exact, fn()) for name, fn in fns.items()}
        flops = 2 * h.shape[0] * WIDTH * 2 * FF
        for name, ms in interleaved_ms({n: graphed(f) for n, f in fns.items()}, rounds=7).items():
            rows.append([name, windows, ms * 1000, flops / ms / 1e9, errors[name]])
        print(table(["ff_in + gate", "windows", "us", "TFLOP/s", "rel err vs float64"], rows[-len(fns):]), flush=True)
    print(table(["ff_in + gate", "windows", "us", "TFLOP/s", "rel err vs float64"], rows), flush=True)


@torch.inference_mode()
def attention_layer(windows: int = 8) -> None:
    from flash_attn.cute.interface import flash_attn_func

    gen = torch.Generator("cuda").manual_seed(1)
    qkv = torch.randn(2 * windows, TOKENS, 3 * WIDTH, device="cuda", generator=gen).bfloat16()
    q, k, v = qkv.view(2 * windows, TOKENS, 3, HEADS, -1).unbind(2)
    exact = F.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q, k, v)))
    exact = exact.transpose(1, 2).reshape(2 * windows, TOKENS, WIDTH)

    def fa4():
        out = flash_attn_func(q, k, v)
        return (out[0] if isinstance(out, tuple) else out).reshape(2 * windows, TOKENS, WIDTH)

    fns = {"ours (kernels/dit_attention.py)": lambda: dit_attention(q, k, v), "flash-attn-4 SM90": fa4}
    errors = {name: rel_err(exact, fn()) for name, fn in fns.items()}
    flops = 4 * 2 * windows * TOKENS**2 * WIDTH
    rows = [[name, windows, ms * 1000, flops / ms / 1e9, errors[name]]
            for name, ms in interleaved_ms({n: graphed(f) for n, f in fns.items()}, rounds=7).items()]
    print(table(["attention", "windows", "us per layer", "TFLOP/s", "rel err vs float64"], rows), flush=True)


@torch.inference_mode()
def whole_call() -> None:
    """The renderer's DiT (rows in pairs) with glu_linear's fused GEMM from MIN_ROWS rows (the engine's), or never."""
    dit, rows, min_rows = fused_bf16_dit(), [], glu_module.MIN_ROWS
    with float32_matmuls("cuda"):
        for windows in (8, 4, 2):
            call = dit_call(dit, windows, "cuda", torch.bfloat16)
            graphs, outs = {}, {}
            for name, threshold in (("cuBLAS + gate pass", 10**9), (f"fused gate from {min_rows} rows", min_rows)):
                glu_module.MIN_ROWS = threshold
                outs[name] = call().double()
                graphs[name] = graphed(call)
            glu_module.MIN_ROWS = min_rows
            (_, ref), (_, fused) = outs.items()
            for name, ms in interleaved_ms(graphs).items():
                rows.append([name, windows, ms, dit_flops(windows) / ms / 1e9 / PEAK_TFLOPS, rel_err(ref, fused)])
            print(table(["DiT call", "windows", "graph ms", "x peak", "rel diff of the outputs"], rows[-2:]),
                  flush=True)
    print(table(["DiT call", "windows", "graph ms", "x peak", "rel diff of the outputs"], rows), flush=True)


@torch.inference_mode()
def precision() -> None:
    """`music3serve bench precision`'s comparison for BFLOAT16 with the gate pass and with the fused gate (forced on
    for the one-window DiT calls of a song rendered alone): the same float32 render, weights, conditioning, noise."""
    from types import SimpleNamespace

    from music3serve.acoustic.precision import BFLOAT16
    from music3serve.bench.common import random_module
    from music3serve.bench.precision import compare_policies
    from music3serve.checkpoint import ACOUSTIC

    def models() -> SimpleNamespace:
        return SimpleNamespace(**{n: random_module(n, "cuda", torch.float32, seed=i) for i, n in enumerate(ACOUSTIC)})

    min_rows, thresholds = glu_module.MIN_ROWS, iter((10**9, 1))

    def load_low() -> SimpleNamespace:
        glu_module.MIN_ROWS = next(thresholds)
        return models()

    variants = [replace(BFLOAT16, name="bfloat16, gate pass"), replace(BFLOAT16, name="bfloat16, fused gate")]
    try:
        for report in compare_policies(models(), load_low, variants, frames=450):
            print(report, flush=True)
    finally:
        glu_module.MIN_ROWS = min_rows


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    section("ff_in + gate, one layer", glu_layer)
    section("attention, one layer", attention_layer)
    section("whole call", whole_call)
    section("precision against float32", precision)
