"""The fused bf16 DiT call (graph) with cuBLAS's default GEMM choices against torch's TunableOp (every cuBLASLt
algorithm timed per GEMM shape, the fastest kept), interleaved in one process so that clock drift cancels: both
graphs are captured on the same weights and inputs, then replayed in alternating rounds; the median of each.

    PYTHONPATH=src python3 bench/dit_tunable.py [results.csv]
"""

from __future__ import annotations

import sys
import time

import torch

from music3serve.acoustic.precision import float32_matmuls
from music3serve.bench.acoustic import PEAK_TFLOPS, dit_call, dit_flops, fused_bf16_dit
from music3serve.bench.common import graphed, interleaved_ms, table

HEADERS = ["GEMMs", "windows", "graph ms", "x peak", "rel diff to default"]


@torch.inference_mode()
def main() -> None:
    tunable = torch.cuda.tunable
    tunable.set_filename(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tunableop_results.csv")
    dit, rows = fused_bf16_dit(), []
    with float32_matmuls("cuda"):
        for windows in (1, 8):
            call = dit_call(dit, windows, "cuda", torch.bfloat16)
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
            for name, ms in interleaved_ms(replays).items():
                rel = ((outputs[name] - outputs["default"]).norm() / outputs["default"].norm()).item()
                rows.append([name, windows, ms, dit_flops(windows) / ms / 1e9 / PEAK_TFLOPS, f"{rel:.1e}"])
                print(table(HEADERS, rows[-1:]), flush=True)
    print(table(HEADERS, rows))
    for entry in tunable.get_results():
        print(*entry)


if __name__ == "__main__":
    main()
