"""The fused bf16 DiT call (graph) with its attention as our Triton kernel against torch's SDPA, interleaved in one
process so that clock drift between runs cancels: both graphs are captured on the same weights and inputs, then
replayed in alternating rounds; the median per call of each over all rounds.

    PYTHONPATH=src python3 bench/dit_attention_ab.py
"""

from __future__ import annotations

import statistics

import torch

from music3serve import contract
from music3serve.acoustic.precision import BFLOAT16, apply_dit_policy, float32_matmuls
from music3serve.bench.acoustic import PEAK_TFLOPS, dit_flops
from music3serve.bench.common import graphed, random_module, table, time_ms
from music3serve.kernels import dit_attention as attention
from music3serve.models import dit as dit_module
from music3serve.models.fusion import enable_fusion

ROUNDS = 15


@torch.inference_mode()
def main() -> None:
    dit = random_module("dit", "cuda", torch.float32)
    apply_dit_policy(dit, BFLOAT16)
    enable_fusion()
    length, rows = contract.latent_length(contract.WINDOW_FRAMES), []
    variants = {"triton kernel": attention.dit_attention, "sdpa": attention.dit_attention_reference}
    with float32_matmuls("cuda"):
        for windows in (1, 8):
            x = torch.randn(2 * windows, 128, length, device="cuda", dtype=torch.bfloat16)
            cond = torch.randn(2 * windows, length, 2048, device="cuda", dtype=torch.bfloat16)
            t = torch.full((2 * windows,), 0.5, device="cuda")
            replays, outputs = {}, {}
            for name, fn in variants.items():
                dit_module.dit_attention = fn
                outputs[name] = dit(x, t, cond).float()
                replays[name] = graphed(lambda: dit(x, t, cond))
            dit_module.dit_attention = attention.dit_attention
            times = {name: [] for name in variants}
            for _ in range(ROUNDS):
                for name, replay in replays.items():
                    times[name].append(time_ms(replay, warmup=1, repeat=5))
            rel = ((outputs["triton kernel"] - outputs["sdpa"]).norm() / outputs["sdpa"].norm()).item()
            for name in variants:
                ms = statistics.median(times[name])
                rows.append([name, windows, ms, dit_flops(windows) / ms / 1e9 / PEAK_TFLOPS, f"{rel:.1e}"])
                print(table(["attention", "windows", "graph ms", "x peak", "rel diff of outputs"], rows[-1:]),
                      flush=True)
    print(table(["attention", "windows", "graph ms", "x peak", "rel diff of outputs"], rows))


if __name__ == "__main__":
    main()
