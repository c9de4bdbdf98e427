"""Where a song's frame step first depends on the songs beside it (GPU; full-size widths, random weights).

Part 1, one frame step of the engine (backbone of --layers layers, the GPU tests' size): song A (its hiddens, KV rows,
seed and frame fixed) solo, again, and beside 1-15 other songs (random rows, NaN past every filled length and in the
graph's idle rows). Eager, every op's output recorded (hot paths, skinny GEMM inputs and outputs, decode attention,
backbone layers); per op the largest |diff| of song A's rows against solo, and the first op that differs. Then the
graphed step (the captured size, or eager beyond it): song A's codes, mixed conditioning, next hiddens and new KV.

Part 2, the kernels alone, each row printed as measured: each op of the frame step on one song's rows alone and as
the first rows of larger batches (every talker GEMM in bf16 and e4m3, the backbone's decode attention, the depth
decoder's first-call attention in every SDPA backend and ours, top-k); max |diff| of those rows against the alone run.

    PYTHONPATH=src python3 bench/batch_invariance_probe.py [--layers 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from music3serve.bench.common import random_module, table
from music3serve.kernels.skinny_linear import MEASURED_GATED_TILES, MEASURED_TILES, skinny_gated_silu, skinny_linear
from music3serve.kernels.top_k import kth_largest
from music3serve.models import condition_encoder, depth_decoder, fusion, language_model, layers
from music3serve.models.depth_decoder import causal_attention
from music3serve.talker import depth_inputs, frame
from music3serve.talker.engine import Talker, TalkerConfig

attention = sys.modules["music3serve.kernels.decode_attention"]
skinny = sys.modules["music3serve.kernels.skinny_linear"]
ROWS = (2, 4, 8, 16, 17, 32, 64, 128)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """0.0 for equal bits (NaN where NaN), else the largest |a - b| (inf where one side is not finite)."""
    if a.shape != b.shape:
        return float("nan")
    if a.dtype in (torch.bool, torch.int32, torch.int64):
        return float((a != b).sum().item())
    a, b = a.float(), b.float()
    same = (a == b) | (a.isnan() & b.isnan())
    return 0.0 if bool(same.all()) else float((a - b).abs().masked_fill(same, 0).nan_to_num(float("inf")).max())


def rows_sweep(fn: Callable[[int], torch.Tensor], head: int, rows=ROWS) -> tuple[str, str]:
    """fn(rows) -> [rows, ...] output; the largest |diff| of its first `head` rows against fn(head), and the row
    counts where they differ."""
    alone = fn(head)[:head]
    diffs = {r: max_diff(fn(r)[:head], alone) for r in rows if r > head}
    return f"{max(diffs.values()):.3g}", ", ".join(str(r) for r, d in diffs.items() if d != 0) or "-"


def part_kernels() -> Iterator[list[Any]]:
    """Rows of the kernels' table, as they are measured."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    gated_shapes = (*MEASURED_GATED_TILES, (24576, 4096))
    shapes = [(n, k, False) for n, k in MEASURED_TILES] + [(n, k, True) for n, k in gated_shapes]
    for n, k, gated in shapes:
        x = torch.randn(max(ROWS), k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
        op = skinny_gated_silu if gated else skinny_linear
        e4m3 = w.to(torch.float8_e4m3fn), torch.ones(n, device="cuda")
        for label, weight, scale in (("bf16", w, None), ("e4m3", *e4m3)):
            sweep = rows_sweep(lambda r: op(x[:r], weight, scale=scale), 2)
            yield [f"skinny {'gated ' if gated else ''}{n}x{k} {label}", 2, *sweep]
    # The backbone's decode attention with its rotation and append, as DecodeRows calls it: A's rows hold 300 positions.
    cap, n_max = 2049, 64
    k_all = torch.randn(n_max, 8, cap, 128, device="cuda", generator=gen).bfloat16()
    v_all = torch.randn_like(k_all)
    q_all = torch.randn(n_max, 32, 128, device="cuda", generator=gen).bfloat16()
    new_k, new_v = torch.randn(2, n_max, 8, 128, device="cuda", generator=gen).bfloat16()
    lengths = torch.randint(1, cap - 1, (n_max,), device="cuda", generator=gen)
    lengths[:2] = 301
    norm_w = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    angles = lengths[:, None].float() * torch.rand(1, 128, device="cuda", generator=gen)

    def backbone_attention(r: int) -> torch.Tensor:
        k_cache, v_cache = k_all[:r].clone(), v_all[:r].clone()
        rotation = (norm_w, norm_w, 1e-6, angles[:r].cos(), angles[:r].sin())
        return attention.decode_attention(q_all[:r], k_cache, v_cache, lengths[:r], append=(new_k[:r], new_v[:r],
                                          lengths[:r] - 1), rotation=rotation)

    yield ["decode attention 32x128 cap 2049", 2, *rows_sweep(backbone_attention, 2, (4, 8, 16, 32, 64))]
    # The depth decoder's first call: 2 positions, 16 heads of 256.
    qkv = torch.randn(3, 128, 16, 2, 256, device="cuda", generator=gen).bfloat16()
    steps = torch.arange(17, device="cuda")[:, None].expand(-1, 128).contiguous()
    backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    for name, backend in backends.items():
        def sdpa(r: int, backend=backend) -> torch.Tensor:
            if backend is None:
                return F.scaled_dot_product_attention(*qkv[:, :r], is_causal=True)
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(*qkv[:, :r], is_causal=True)
        try:
            yield [f"depth first-call SDPA {name}", 2, *rows_sweep(sdpa, 2, (4, 8, 16, 32, 64, 128))]
        except RuntimeError as exc:
            yield [f"depth first-call SDPA {name}", 2, f"unavailable: {str(exc)[:60]}", ""]
    ours = rows_sweep(lambda r: causal_attention(*qkv[:, :r], steps[:, :r]), 2, (4, 8, 16, 32, 64, 128))
    yield ["depth first-call causal_attention (ours)", 2, *ours]
    for columns, k in ((16385, 50), (1024, 50)):
        logits = torch.randn(64, columns, device="cuda", generator=gen)
        sweep = rows_sweep(lambda r: kth_largest(logits[:r], k), 1, (2, 4, 16, 64))
        yield [f"kth_largest {columns} columns", 1, *sweep]


class Recorder:
    """Records song A's rows of every op output while `records` is a list: hot paths (models/fusion.py), the skinny
    GEMM's launches (input and output), decode attention, the mix and the backbone layers."""

    def __init__(self, talker: Talker) -> None:
        self.records: list[tuple[str, torch.Tensor]] | None = None
        self.talker, self.pair, self.songs = talker, 0, 1
        # The hot paths' names in the modules that call them from eager code (not sampling's: compiled guided_draw
        # calls sample_top_k, and a changed global there would recompile it).
        for module in (frame, depth_inputs, layers, language_model, depth_decoder, condition_encoder):
            for attr, fn in list(vars(module).items()):
                if callable(getattr(fn, "__wrapped__", None)) and fusion._name(fn.__wrapped__) in fusion._plain:
                    setattr(module, attr, self.wrap(attr, fn))
        run_kernel, triton_attention = skinny.run_kernel, attention._decode_attention_triton

        def recorded_gemm(x, w, config, gated=False, residual=None, scale=None):
            y = run_kernel(x, w, config, gated=gated, residual=residual, scale=scale)
            name = f"gemm {w.shape[0]}x{w.shape[1]}{' gated' if gated else ''}"
            self.add(f"{name} in", x.reshape(-1, x.shape[-1]))
            self.add(f"{name} out", y.reshape(-1, y.shape[-1]))
            return y

        def recorded_attention(q, k_cache, *args, **kwargs):
            out = triton_attention(q, k_cache, *args, **kwargs)
            self.add(f"attention {q.shape[1]}x{q.shape[2]} cap {k_cache.shape[2]}", out)
            return out

        skinny.run_kernel, attention._decode_attention_triton = recorded_gemm, recorded_attention
        for i, layer in enumerate(talker.lm.layers):
            layer.register_forward_hook(lambda module, args, out, i=i: self.add(f"backbone layer {i}", out))

    def wrap(self, name: str, fn: Callable) -> Callable:
        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            for j, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.add(f"{name}[{j}]", t)
            return out

        return recorded

    def add(self, name: str, t: torch.Tensor) -> None:
        """Song A's share of t's leading dim (per song, per row, per depth position)."""
        if self.records is None or t.dim() == 0 or t.shape[0] % self.songs:
            return
        share = t.shape[0] // self.songs
        self.records.append((name, t[self.pair * share : (self.pair + 1) * share].clone()))

    def run(self, fn: Callable[[], None], pair: int, songs: int) -> list[tuple[str, torch.Tensor]]:
        self.records, self.pair, self.songs = [], pair, songs
        fn()
        synchronize(self.talker)
        records, self.records = self.records, None
        return records


def set_state(talker: Talker, songs: int, pair: int, filled: int = 300) -> None:
    """Song A in `pair` (hiddens, seed 7, frame 5, `filled` KV positions, all fixed), other songs in the other pairs
    (random), NaN past every filled length and in the hiddens of the idle rows."""
    step, slots, device = talker.step_fn, talker.slots, talker.device
    gen = torch.Generator(device=device).manual_seed(1000 + songs * 37 + pair)
    slots.k.fill_(float("nan"))
    slots.v.fill_(float("nan"))
    step.hidden.fill_(float("nan"))
    step.positions.fill_(slots.scratch)
    step.seeds.random_(0, 2**62, generator=gen)
    step.frames.random_(0, 5000, generator=gen)
    for p in range(songs):
        own = torch.Generator(device=device).manual_seed(7) if p == pair else gen
        length = filled if p == pair else int(torch.randint(5, slots.scratch, (), device=device, generator=gen))
        rows = slice(2 * p, 2 * p + 2)
        for cache in (slots.k, slots.v):
            cache[:, rows, :, :length] = torch.randn(cache[:, rows, :, :length].shape, device=device, generator=own)
        step.hidden[rows] = torch.randn(2, step.hidden.shape[1], device=device, generator=own)
        step.positions[rows] = length
        if p == pair:
            step.seeds[p], step.frames[p] = 7, 5


def outcome(talker: Talker, pair: int, filled: int = 300) -> dict[str, torch.Tensor]:
    step, rows = talker.step_fn, slice(2 * pair, 2 * pair + 2)
    return {"codes": step.codes[pair].clone(), "mixed": step.mixed[pair].clone(),
            "next hiddens": step.hidden[rows].clone(), "new keys": talker.slots.k[:, rows, :, filled].clone(),
            "new values": talker.slots.v[:, rows, :, filled].clone()}


CASES = {  # name: (songs, song A's pair)
    "solo": (1, 0), "solo again": (1, 0), "beside 1": (2, 0), "in pair 1": (2, 1), "beside 2 (idle rows)": (3, 0),
    "beside 3": (4, 0), "beside 7": (8, 0), "beside 15 (eager)": (16, 0), "last of 16": (16, 15),
}


def part_step(backbone_layers: int) -> None:
    started = time.perf_counter()
    lm = random_module("language_model", "cuda", torch.bfloat16, num_hidden_layers=backbone_layers)
    depth = random_module("depth_decoder", "cuda", torch.bfloat16, seed=1)
    encoder = random_module("condition_encoder", "cuda", torch.float32, seed=2)
    talker = Talker(lm, depth, encoder, TalkerConfig(max_num_seqs=32, max_model_len=2048, capture_sizes=(2, 4, 8, 16)))
    print(f"talker built and captured in {time.perf_counter() - started:.0f} s", flush=True)
    torch._logging.set_logs(recompiles=True)  # a hot path compiled anew for a case runs other kernels than the graphs
    compare(talker)


def synchronize(talker: Talker) -> None:
    if talker.device.type == "cuda":
        torch.cuda.synchronize(talker.device)


def compare(talker: Talker) -> None:
    """Every case eager (recorded) and graphed; prints the tables."""
    recorder, step = Recorder(talker), talker.step_fn
    eager, graphed = {}, {}
    with torch.cuda.stream(step.stream):
        for case, (songs, pair) in CASES.items():
            set_state(talker, songs, pair)
            eager[case] = (recorder.run(lambda: step.run_eager(2 * songs), pair, songs), outcome(talker, pair))
            set_state(talker, songs, pair)
            step(2 * songs)
            synchronize(talker)
            graphed[case] = outcome(talker, pair)
    solo_records = eager["solo"][0]
    by_op: dict[str, dict[str, float]] = defaultdict(dict)
    firsts = []
    for case, (records, _) in eager.items():
        names = [n for n, _ in records]
        if names != [n for n, _ in solo_records]:
            firsts.append([case, "op sequence differs from solo", len(records), len(solo_records), ""])
            continue
        diffs = [max_diff(t, s) for (_, t), (_, s) in zip(records, solo_records)]
        for (name, _), d in zip(records, diffs):
            by_op[name][case] = max(by_op[name].get(case, 0.0), d)
        bad = [i for i, d in enumerate(diffs) if d != 0]
        first = f"#{bad[0]} {names[bad[0]]} ({diffs[bad[0]]:.3g})" if bad else "-"
        firsts.append([case, first, len(bad), len(records), ", ".join(dict.fromkeys(names[i] for i in bad[:40]))[:200]])
    print("\nEager frame step, song A's rows against solo (ops in step order):")
    print(table(["case", "first differing op (max |diff|)", "ops differing", "ops", "differing op kinds"], firsts))
    cases = list(eager)
    differing = {op: d for op, d in by_op.items() if any(v != 0 for v in d.values())}
    same = len(by_op) - len(differing)
    print(f"\nLargest |diff| per op kind that differs somewhere ({same} other kinds: bit for bit in every case):")
    print(table(["op", *cases[1:]], [[op, *[f"{d.get(c, float('nan')):.3g}" for c in cases[1:]]]
                                     for op, d in differing.items()]))
    outputs = list(graphed["solo"])
    rows = [[case, *[f"{max_diff(graphed[case][o], graphed['solo'][o]):.3g}" for o in outputs],
             f"{max(max_diff(graphed[case][o], eager[case][1][o]) for o in outputs):.3g}",
             f"{max(max_diff(eager[case][1][o], eager['solo'][1][o]) for o in outputs):.3g}"] for case in cases]
    print("\nGraphed step (the captured size, eager beyond): song A's outputs against graphed solo; the largest "
          "difference of its graphed outputs from its eager ones, and of its eager outputs from eager solo's:")
    print(table(["case", *outputs, "graph vs own eager", "eager vs solo eager"], rows))


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4, help="backbone layers (36 in the released model)")
    args = parser.parse_args()
    started = time.perf_counter()
    part_step(args.layers)
    print(f"({time.perf_counter() - started:.0f} s)\n\nKernels alone: a song's rows alone against the same rows "
          "first in larger batches", flush=True)
    headers = ["op", "song rows", "max |diff|", "row counts that differ"]
    print(table(headers, []), flush=True)
    for row in part_kernels():
        print(table(headers, [row]).splitlines()[-1], flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")

if __name__ == "__main__":
    main()
