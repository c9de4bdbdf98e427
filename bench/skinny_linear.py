"""The talker's weight shapes at 2 and 16 rows: cuBLAS (F.linear) against the skinny kernel (kernels/skinny_linear.py),
in GB/s of weight read and as a share of copy bandwidth, per call inside a CUDA graph, weights cycling through
more copies than the L2 cache holds (as in a real step, where every layer has its own weights). Also checks each
result against the float32-accumulated reference and batch invariance (rows 0-1 of 16 rows equal 2 rows alone).
With --sweep it times every tile configuration and prints the best per shape.

    PYTHONPATH=src python3 bench/skinny_linear.py [--sweep]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from music3serve.bench.common import COPY_BW, graphed, table, time_ms
from music3serve.kernels.skinny_linear import (
    gated_silu_reference,
    run_kernel,
    skinny_gated_silu,
    skinny_linear,
    skinny_linear_reference,
    tile_config,
)

# (name, N, K, calls per frame for one song): Qwen3-8B backbone, then the depth decoder (7 calls x 4 blocks).
SHAPES = [
    ("lm qkv", 6144, 4096, 36), ("lm o", 4096, 4096, 36), ("lm gate_up", 24576, 4096, 36),
    ("lm down", 4096, 12288, 36), ("lm head", 16385, 4096, 1),
    ("depth qkv, gate_up", 12288, 4096, 56), ("depth o, projection", 4096, 4096, 35),
    ("depth down", 4096, 6144, 28), ("depth heads", 1024, 4096, 7),
]
# gate_up with SiLU * up: the torch ops (cuBLAS, then one elementwise kernel) against the gated kernel.
GATED = [("lm gate_up + silu", 24576, 4096), ("depth gate_up + silu", 12288, 4096)]
ROWS = (2, 16)
CYCLE_BYTES = 512 << 20  # weights cycled per timed graph, well past the 60 MB L2


def per_call_ms(fn, x, weights) -> float:
    replay = graphed(lambda: [fn(x, w) for w in weights])
    return time_ms(replay) / len(weights)


def configs():
    for block_n, block_k, warps, stages in itertools.product((16, 32, 64, 128), (128, 256, 512), (4, 8), (3, 4, 6)):
        if block_n * block_k * 2 * stages <= 160 << 10:
            yield block_n, block_k, warps, stages


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="time every tile configuration per shape")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows_out, frame_ms = [], {"cuBLAS": 0.0, "skinny": 0.0}
    best = {}
    for name, n, k, per_frame in SHAPES:
        copies = max(2, CYCLE_BYTES // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        floor_us = n * k * 2 / COPY_BW * 1e6
        x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        invariant = torch.equal(skinny_linear(x16, weights[0])[:2], skinny_linear(x16[:2].clone(), weights[0]))
        for rows in ROWS:
            x = x16[:rows].contiguous()
            ref = skinny_linear_reference(x, weights[0]).float()
            err = ((skinny_linear(x, weights[0]).float() - ref).abs().max() / ref.abs().max()).item()
            cublas = per_call_ms(F.linear, x, weights) * 1e3
            ours = per_call_ms(skinny_linear, x, weights) * 1e3
            if rows == 2:
                frame_ms["cuBLAS"] += per_frame * cublas / 1e3
                frame_ms["skinny"] += per_frame * ours / 1e3
            rows_out.append([name, n, k, rows, floor_us, cublas, floor_us / cublas, ours, floor_us / ours,
                             str(tile_config(n, k)), f"{err:.1e}", invariant])
            if args.sweep:
                timed = []
                for config in configs():
                    try:
                        timed.append((per_call_ms(lambda a, b: run_kernel(a, b, config), x, weights) * 1e3, config))
                    except Exception as exc:  # a configuration the compiler rejects (shared memory, registers)
                        print(f"{name} {config}: {type(exc).__name__}")
                timed.sort()
                best[(name, rows)] = timed[:3]
        del weights
    for name, n, k in GATED:
        copies = max(2, CYCLE_BYTES // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        floor_us = n * k * 2 / COPY_BW * 1e6
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = gated_silu_reference(x, weights[0]).float()
            err = ((skinny_gated_silu(x, weights[0]).float() - ref).abs().max() / ref.abs().max()).item()
            torch_us = per_call_ms(gated_silu_reference, x, weights) * 1e3
            ours = per_call_ms(skinny_gated_silu, x, weights) * 1e3
            rows_out.append([name, n, k, rows, floor_us, torch_us, floor_us / torch_us, ours, floor_us / ours,
                             "gated", f"{err:.1e}", "-"])
        del weights
    headers = ["shape", "N", "K", "rows", "floor us", "cuBLAS us", "cuBLAS x BW", "skinny us", "skinny x BW",
               "config", "rel err", "rows 0-1 of 16 == 2 rows"]
    print(table(headers, rows_out))
    print(f"\nGEMMs of one song's frame (2 rows, calls x per-call time): cuBLAS {frame_ms['cuBLAS']:.2f} ms, "
          f"skinny {frame_ms['skinny']:.2f} ms")
    for (name, rows), top in best.items():
        print(f"best {name} rows {rows}: " + ", ".join(f"{us:.2f} us {cfg}" for us, cfg in top))


if __name__ == "__main__":
    main()
