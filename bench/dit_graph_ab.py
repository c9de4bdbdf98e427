"""The fused bf16 DiT call at eight windows replayed as a CUDA graph against the same call launched eagerly, in
alternating rounds in one process so that clock drift cancels; the median of each.

    PYTHONPATH=src python3 bench/dit_graph_ab.py
"""

from __future__ import annotations

import torch

from music3serve.acoustic.precision import float32_matmuls
from music3serve.bench.acoustic import PEAK_TFLOPS, dit_call, dit_flops, fused_bf16_dit
from music3serve.bench.common import graphed, interleaved_ms, table

HEADERS = ["launch", "windows", "ms", "x peak"]


@torch.inference_mode()
def main() -> None:
    dit, rows = fused_bf16_dit(), []
    with float32_matmuls("cuda"):
        for windows in (8, 1):
            call = dit_call(dit, windows, "cuda", torch.bfloat16)
            for name, ms in interleaved_ms({"graph": graphed(call), "eager": call}).items():
                rows.append([name, windows, ms, dit_flops(windows) / ms / 1e9 / PEAK_TFLOPS])
                print(table(HEADERS, rows[-1:]), flush=True)
    print(table(HEADERS, rows))


if __name__ == "__main__":
    main()
