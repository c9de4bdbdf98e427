"""The fused bf16 DiT call (graph) with cuBLAS's default GEMM choices against torch's TunableOp (every cuBLASLt
algorithm timed per GEMM shape, the fastest kept), interleaved in one process so that clock drift cancels: both
graphs are captured on the same weights and inputs, then replayed in alternating rounds; the median of each.

    PYTHONPATH=src python3 bench/dit_tunable.py [results.csv]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from music3serve import contract
from music3serve.acoustic.precision import BFLOAT16, apply_dit_policy, float32_matmuls
from music3serve.bench.acoustic import PEAK_TFLOPS, dit_flops
from music3serve.bench.common import graphed, random_module, table, time_ms
from music3serve.models.fusion import enable_fusion

ROUNDS = 15
HEADERS = ["GEMMs", "windows", "graph ms", "x peak", "rel diff to default"]


@torch.inference_mode()
def main() -> None:
    tunable = torch.cuda.tunable
    tunable.set_filename(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tunableop_results.csv")
    dit = random_module("dit", "cuda", torch.float32)
    apply_dit_policy(dit, BFLOAT16)
    enable_fusion()
    length, rows = contract.latent_length(contract.WINDOW_FRAMES), []
    with float32_matmuls("cuda"):
        for windows in (1, 8):
            x = torch.randn(2 * windows, 128, length, device="cuda", dtype=torch.bfloat16)
            cond = torch.randn(2 * windows, length, 2048, device="cuda", dtype=torch.bfloat16)
            t = torch.full((2 * windows,), 0.5, device="cuda")
            call = lambda: dit(x, t, cond)  # noqa: E731
            tunable.enable(False)
            outputs = {"default": call().float()}
            replays = {"default": graphed(call)}
            tunable.enable(True)
            tunable.tuning_enable(True)
            began = time.perf_counter()
            call()
            torch.cuda.synchronize()
            print(f"{windows} windows: tuned in {time.perf_counter() - began:.1f} s", flush=True)
            tunable.tuning_enable(False)
            outputs["TunableOp"] = call().float()
            replays["TunableOp"] = graphed(call)
            tunable.enable(False)
            times = {name: [] for name in replays}
            for _ in range(ROUNDS):
                for name, replay in replays.items():
                    times[name].append(time_ms(replay, warmup=1, repeat=5))
            for name in replays:
                rel = ((outputs[name] - outputs["default"]).norm() / outputs["default"].norm()).item()
                ms = statistics.median(times[name])
                rows.append([name, windows, ms, dit_flops(windows) / ms / 1e9 / PEAK_TFLOPS, f"{rel:.1e}"])
                print(table(HEADERS, rows[-1:]), flush=True)
    print(table(HEADERS, rows))
    for entry in tunable.get_results():
        print(*entry)


if __name__ == "__main__":
    main()
