"""Which SDPA backend runs the DiT's attention fastest? At eight windows the attention (16 sequences of 690 tokens,
32 heads of 64) took 9.2 ms of a ~102 ms call in cuDNN (~240 TFLOP/s, docs/performance.md round 6): the
largest piece left outside the GEMMs. The fused bf16 DiT call (graph) with torch's default choice, then each
backend forced, same inputs; the output's relative difference to the default's says the backends agree.

    PYTHONPATH=src python3 bench/dit_sdpa.py
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from music3serve import contract
from music3serve.acoustic.precision import BFLOAT16, apply_dit_policy, float32_matmuls
from music3serve.bench.acoustic import PEAK_TFLOPS, dit_flops
from music3serve.bench.common import graphed, random_module, table, time_ms
from music3serve.models.fusion import enable_fusion

BACKENDS = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


@torch.inference_mode()
def main() -> None:
    dit = random_module("dit", "cuda", torch.float32)
    apply_dit_policy(dit, BFLOAT16)
    enable_fusion()
    length, rows = contract.latent_length(contract.WINDOW_FRAMES), []
    with float32_matmuls("cuda"):
        for windows in (1, 8):
            gen = torch.Generator(device="cuda").manual_seed(windows)
            x = torch.randn(2 * windows, 128, length, device="cuda", generator=gen).bfloat16()
            cond = torch.randn(2 * windows, length, 2048, device="cuda", generator=gen).bfloat16()
            t = torch.full((2 * windows,), 0.5, device="cuda")
            baseline = dit(x, t, cond).float()
            for name, backend in BACKENDS.items():
                try:
                    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                        out = dit(x, t, cond).float()
                        ms = time_ms(graphed(lambda: dit(x, t, cond)))
                except RuntimeError as exc:  # a backend that cannot take these inputs
                    print(f"{name}: {str(exc).splitlines()[0]}")
                    continue
                diff = ((out - baseline).norm() / baseline.norm()).item()
                rows.append([name, windows, ms, dit_flops(windows) / ms / 1e9 / PEAK_TFLOPS, diff])
                print(table(["backend", "windows", "graph ms", "x peak", "rel diff to default"], rows[-1:]), flush=True)
    print(table(["backend", "windows", "graph ms", "x peak", "rel diff to default"], rows))


if __name__ == "__main__":
    main()
