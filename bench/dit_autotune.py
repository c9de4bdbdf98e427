"""Does inductor's max-autotune (Triton GEMM templates with the SiLU-gate and residual epilogues fused) beat the
default fused DiT (cuBLAS GEMMs, elementwise kernels between them: ~15% of an eight-window call)?

    PYTHONPATH=src python3 bench/dit_autotune.py
"""

from __future__ import annotations

import time

import torch

from music3serve import contract
from music3serve.acoustic.precision import BFLOAT16, apply_dit_policy, float32_matmuls
from music3serve.bench.acoustic import PEAK_TFLOPS, dit_flops
from music3serve.bench.common import graphed, random_module, table, time_ms
from music3serve.models.fusion import disable_fusion, enable_fusion


@torch.inference_mode()
def main() -> None:
    dit = random_module("dit", "cuda", torch.float32)
    apply_dit_policy(dit, BFLOAT16)
    length, rows, baseline = contract.latent_length(contract.WINDOW_FRAMES), [], {}
    for mode in (None, "max-autotune-no-cudagraphs"):
        disable_fusion()
        torch._dynamo.reset()
        enable_fusion(mode=mode)
        with float32_matmuls("cuda"):
            for windows in (1, 8):
                gen = torch.Generator(device="cuda").manual_seed(windows)  # the same inputs for both modes
                x = torch.randn(2 * windows, 128, length, device="cuda", generator=gen).bfloat16()
                cond = torch.randn(2 * windows, length, 2048, device="cuda", generator=gen).bfloat16()
                t = torch.full((2 * windows,), 0.5, device="cuda")
                started = time.perf_counter()
                reference = dit(x, t, cond)
                compile_s = time.perf_counter() - started
                ms = time_ms(graphed(lambda: dit(x, t, cond)))
                rows.append([mode or "default", windows, compile_s, ms, dit_flops(windows) / ms / 1e9 / PEAK_TFLOPS])
                if mode is None:
                    baseline[windows] = reference
                else:
                    expected = baseline[windows].float()
                    error = (reference.float() - expected).norm() / expected.norm()
                    print(f"{windows} window(s): max-autotune vs default relative error {error:.2e}")
                print(table(["compile mode", "windows", "first call s", "graph ms", "x peak"], rows[-1:]), flush=True)
    print(table(["compile mode", "windows", "first call s", "graph ms", "x peak"], rows))


if __name__ == "__main__":
    main()
