"""`music3serve bench acoustic`: DiT call time for cond+uncond of 1/2/4/8 windows, per precision, and the vocoder."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import nn

from .. import contract
from ..acoustic.precision import BFLOAT16, FLOAT32, FP8, PrecisionPolicy, apply_dit_policy, float32_matmuls
from ..checkpoint import ACOUSTIC
from ..kernels import glu_linear
from ..models.fusion import disable_fusion, enable_fusion
from .common import FULL_CONFIGS, graphed, random_module, table, time_ms

PEAK_TFLOPS = 791.0
# BFLOAT16 with its islands' Linear layers as IEEE float32 GEMMs instead of bf16x3 (acoustic/precision.py).
IEEE_ISLANDS = replace(BFLOAT16, name="bfloat16, IEEE islands", dit_island_matmuls="ieee")


def block_gemms(windows: int, length: int = contract.latent_length(contract.WINDOW_FRAMES)) -> list[tuple[int, int, int]]:
    """(M, N, K) of one DiT block's qkv, o, ff_in and ff_out GEMMs over cond + uncond of `windows` windows."""
    c = FULL_CONFIGS["dit"]
    width, ff, m = c["num_attention_heads"] * c["attention_head_dim"], c["ff_inner_dim"], 2 * windows * (length + 1)
    return [(m, 3 * width, width), (m, width, width), (m, 2 * ff, width), (m, width, ff)]


@torch.inference_mode()
def gemm_rates(device: str = "cuda", windows: int = 8) -> dict[str, float]:
    """TFLOP/s of the DiT blocks' four GEMMs at `windows` windows: bf16 F.linear, and torch._scaled_mm on e4m3 inputs
    with rowwise scales (the FP8 floor's rate; activation quantization not included)."""
    from ..models.fp8 import quantize, quantize_rows

    calls: dict[str, list] = {"bf16": [], "fp8": []}
    for m, n, k in block_gemms(windows):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5
        codes, scale = quantize_rows(x)
        q = quantize(w)
        calls["bf16"].append(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        calls["fp8"].append(lambda c=codes, s=scale, q=q: torch._scaled_mm(
            c, q.codes.T, scale_a=s, scale_b=q.scale[None, :], out_dtype=torch.bfloat16))
    flops = sum(2 * m * n * k for m, n, k in block_gemms(windows))
    return {name: flops / time_ms(lambda fns=fns: [f() for f in fns]) / 1e9 for name, fns in calls.items()}


def dit_flops(windows: int, length: int = contract.latent_length(contract.WINDOW_FRAMES)) -> float:
    """Matmul FLOPs of one DiT call over cond + uncond of `windows` windows."""
    c = FULL_CONFIGS["dit"]
    width, ff, tokens = c["num_attention_heads"] * c["attention_head_dim"], c["ff_inner_dim"], length + 1
    stem = 2 * c["in_channels"] + c["condition_dim"]
    block = 2 * tokens * (4 * width * width + 3 * width * ff) + 4 * tokens * tokens * width
    per_sequence = c["num_layers"] * block + 2 * length * (stem * stem + stem * width + width * c["in_channels"])
    return 2 * windows * per_sequence


def fused_bf16_dit(device: str = "cuda") -> nn.Module:
    """The full-size DiT with random weights under the bf16 policy, its hot paths fused: as the renderer runs it."""
    dit = random_module("dit", device, torch.float32)
    apply_dit_policy(dit, BFLOAT16)
    enable_fusion()
    return dit


def dit_call(dit: nn.Module, windows: int, device: str, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """One DiT call over cond + uncond of `windows` full-length windows, on random latents and conditioning."""
    length = contract.latent_length(contract.WINDOW_FRAMES)
    x = torch.randn(2 * windows, 128, length, device=device, dtype=dtype)
    cond = torch.randn(2 * windows, length, 2048, device=device, dtype=dtype)
    t = torch.full((2 * windows,), 0.5, device=device)
    return lambda: dit(x, t, cond)


@torch.inference_mode()
def dit_rows(device: str, policy: PrecisionPolicy, batches, fuse: bool) -> list[list]:
    """DiT calls as the renderer makes them under `policy` (islands, TF32 off), hot paths fused or not."""
    dit = random_module("dit", device, torch.float32)
    apply_dit_policy(dit, policy)
    (enable_fusion if fuse else disable_fusion)()
    rows = []
    with float32_matmuls(device):
        for windows in batches:
            call = dit_call(dit, windows, device, policy.dit)
            eager, graph = time_ms(call), time_ms(graphed(call))
            best = min(eager, graph)
            rows.append([policy.name + (", fused" if fuse else ""), windows, eager, graph,
                         dit_flops(windows) / best / 1e9, dit_flops(windows) / best / 1e9 / PEAK_TFLOPS])
    disable_fusion()
    torch.cuda.empty_cache()
    return rows


@torch.inference_mode()
def vocoder_ms(device: str, dtype: torch.dtype) -> float:
    vocoder = random_module("vocoder", device, dtype)
    latents = torch.randn(1, 128, contract.latent_length(contract.WINDOW_FRAMES), device=device, dtype=dtype)
    return time_ms(lambda: vocoder(latents))


def run(device: str = "cuda", batches=(1, 2, 4, 8), peers: bool = True, quantization: str = "none") -> str:
    """quantization "fp8": also the FP8 policy's calls, and the FP8 GEMM rate measured in the same run."""
    rows = dit_rows(device, FLOAT32, [b for b in batches if b <= 2], fuse=False)  # slow: 1 and 2 windows
    rows += dit_rows(device, BFLOAT16, batches, fuse=False) + dit_rows(device, BFLOAT16, batches, fuse=True)
    rows += dit_rows(device, IEEE_ISLANDS, batches, fuse=True)
    if quantization == "fp8":
        rows += dit_rows(device, FP8, batches, fuse=True)
    with float32_matmuls(device):
        vocoder = {str(d).removeprefix("torch."): vocoder_ms(device, d) for d in (torch.float32, torch.bfloat16)}
    with float32_matmuls(device, conv_tf32=True):
        vocoder["float32 with TF32 convolutions"] = vocoder_ms(device, torch.float32)
    headers = ["policy", "windows", "eager ms", "graph ms", "TFLOP/s", "x peak"]
    no_fusion = glu_linear.unavailable_reason(torch.empty(0, 0, device=device, dtype=torch.bfloat16))
    gate = f"a separate pass ({no_fusion})" if no_fusion else f"quack's GEMM from {glu_linear.MIN_ROWS} rows"
    out = [f"DiT call = cond + uncond of N windows of 689 latent columns; {dit_flops(1) / 1e12:.2f} TFLOP per window; "
           f"bf16 feed-forward gate: {gate}", "", table(headers, rows), "", "vocoder per 689-column window: " +
           ", ".join(f"{k} {v:.2f} ms" for k, v in vocoder.items())]
    if quantization == "fp8":
        rates = gemm_rates(device)
        out.append("DiT block GEMMs at 8 windows: " + ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in rates.items())
                   + f"; an FP8 call at that rate: {dit_flops(8) / rates['fp8'] / 1e9:.1f} ms for 8 windows")
    if peers:
        from .peers import diffusers_dit_ms

        out.append(
            f"diffusers 0.42.1 single-branch DiT call: bf16 {diffusers_dit_ms(device, torch.bfloat16):.2f} ms, "
            f"float32 (TF32 off) {diffusers_dit_ms(device, torch.float32):.2f} ms, "
            f"float32 with TF32 {diffusers_dit_ms(device, torch.float32, tf32=True):.2f} ms"
        )
    return "\n".join(out)


@torch.inference_mode()
def precision(device: str = "cuda", frames: int = 450, steps: int = contract.DIT_STEPS) -> str:
    """The bf16 policy and its candidate variants against float32 on full-size random weights (same weights,
    conditioning and noise)."""
    from types import SimpleNamespace

    from .precision import compare_policies

    def models() -> SimpleNamespace:
        return SimpleNamespace(**{n: random_module(n, device, torch.float32, seed=i) for i, n in enumerate(ACOUSTIC)})

    variants = [
        BFLOAT16,
        IEEE_ISLANDS,
        replace(BFLOAT16, name="bfloat16, IEEE float32 vocoder", vocoder_tf32=False),
        replace(BFLOAT16, name="bfloat16, bf16 vocoder", vocoder=torch.bfloat16),
    ]
    return "\n".join(str(r) for r in compare_policies(models(), models, variants, frames=frames, steps=steps))
