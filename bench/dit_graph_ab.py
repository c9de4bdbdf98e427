"""The fused bf16 DiT call at eight windows replayed as a CUDA graph against the same call launched eagerly, in
alternating rounds in one process so that clock drift cancels; the median of each.

    PYTHONPATH=src python3 bench/dit_graph_ab.py
"""

from __future__ import annotations

import statistics

import torch

from music3serve import contract
from music3serve.acoustic.precision import BFLOAT16, apply_dit_policy, float32_matmuls
from music3serve.bench.acoustic import PEAK_TFLOPS, dit_flops
from music3serve.bench.common import graphed, random_module, table, time_ms
from music3serve.models.fusion import enable_fusion

ROUNDS = 15
HEADERS = ["launch", "windows", "ms", "x peak"]


@torch.inference_mode()
def main() -> None:
    dit = random_module("dit", "cuda", torch.float32)
    apply_dit_policy(dit, BFLOAT16)
    enable_fusion()
    length, rows = contract.latent_length(contract.WINDOW_FRAMES), []
    with float32_matmuls("cuda"):
        for windows in (8, 1):
            x = torch.randn(2 * windows, 128, length, device="cuda", dtype=torch.bfloat16)
            cond = torch.randn(2 * windows, length, 2048, device="cuda", dtype=torch.bfloat16)
            t = torch.full((2 * windows,), 0.5, device="cuda")
            call = lambda: dit(x, t, cond)  # noqa: E731
            variants = {"graph": graphed(call), "eager": call}
            times = {name: [] for name in variants}
            for _ in range(ROUNDS):
                for name, fn in variants.items():
                    times[name].append(time_ms(fn, warmup=1, repeat=5))
            for name in variants:
                ms = statistics.median(times[name])
                rows.append([name, windows, ms, dit_flops(windows) / ms / 1e9 / PEAK_TFLOPS])
                print(table(HEADERS, rows[-1:]), flush=True)
    print(table(HEADERS, rows))


if __name__ == "__main__":
    main()
