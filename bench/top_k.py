"""The sampler's threshold per call: torch.topk (unsorted, then its minimum) against kernels/top_k.py's bitonic
kernel at 1, 2, 4 and 8 warps, for the depth decoder's rows (1024 columns, one pass) and the semantic rows (16385
columns, two passes) at one and eight songs; 20 calls in one graph, per call.

    PYTHONPATH=src python3 bench/top_k.py
"""

from __future__ import annotations

import torch

from music3serve.bench.common import graphed, table, time_ms
from music3serve.kernels.top_k import kth_largest, kth_largest_reference

CALLS = 20


def per_call_us(fn) -> float:
    return time_ms(graphed(lambda: [fn() for _ in range(CALLS)])) / CALLS * 1e3


@torch.inference_mode()
def main() -> None:
    rows_out = []
    for columns in (1024, 16385):
        for rows in (2, 16):  # one and eight songs' cond/uncond rows
            x = torch.randn(rows, columns, device="cuda") * 4
            row = [columns, rows, per_call_us(lambda: kth_largest_reference(x, 50))]
            row += [per_call_us(lambda w=w: kth_largest(x, 50, num_warps=w)) for w in (1, 2, 4, 8)]
            rows_out.append(row)
    print(table(["columns", "rows", "torch.topk us", "1 warp us", "2 warps us", "4 warps us", "8 warps us"], rows_out))


if __name__ == "__main__":
    main()
