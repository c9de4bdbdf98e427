"""The talker's weight shapes at 2 and 16 rows: the torch ops (cuBLAS F.linear; for gate_up also SiLU * up) against
the skinny kernels (kernels/skinny_linear.py), per call inside a CUDA graph and as a share of copy bandwidth, the
weights cycling through more copies than the L2 cache holds (as in a real step, where every layer has its own
weights). Also prints each result's largest difference from the torch ops and whether rows 0-1 of 16 rows equal
the same 2 rows alone (batch invariance).
With --sweep it times every tile configuration and prints the best per shape (for the gated kernel, BLOCK_N is
the columns of gate and of up each).

    PYTHONPATH=src python3 bench/skinny_linear.py [--sweep [--kwarps]] [--rows 2 16]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from music3serve.bench.common import copy_bandwidth, graphed, table, time_ms
from music3serve.kernels.skinny_linear import (
    gated_silu_reference,
    skinny_gated_silu,
    skinny_linear,
    tile_config,
)
from music3serve.kernels.skinny_linear_kernel import run_kernel

# (name, N, K, calls per frame for one song, gated): Qwen3-8B backbone, then the depth decoder (7 calls x 4 blocks).
# gate_up runs gated (SiLU * up in the kernel), against the torch ops (cuBLAS, then one elementwise kernel).
SHAPES = [
    ("lm qkv", 6144, 4096, 36, False), ("lm o", 4096, 4096, 36, False), ("lm gate_up + silu", 24576, 4096, 36, True),
    ("lm down", 4096, 12288, 36, False), ("lm head", 16385, 4096, 1, False),
    ("depth qkv", 12288, 4096, 28, False), ("depth gate_up + silu", 12288, 4096, 28, True),
    ("depth o, projection", 4096, 4096, 36, False), ("depth down", 4096, 6144, 28, False),
    ("depth heads", 1024, 4096, 7, False),
]
ROWS = (2, 16)
CYCLE_BYTES = 512 << 20  # weights cycled per timed graph, well past the 60 MB L2


def per_call_ms(fn, x, weights) -> float:
    replay = graphed(lambda: [fn(x, w) for w in weights])
    return time_ms(replay) / len(weights)


def configs(k_over_warps: bool = False):
    """Tiles to sweep; k_over_warps: each also with K over its warps (skinny_linear_kernel.VARIANTS' "-kwarps")."""
    for block_n, block_k, warps, stages in itertools.product((16, 32, 64, 128), (128, 256, 512), (4, 8), (3, 4, 6)):
        if block_n * block_k * 2 * stages <= 160 << 10:
            yield block_n, block_k, warps, stages
            if k_over_warps and block_k % (16 * warps) == 0:
                yield block_n, block_k, warps, stages, "cvt-kwarps"


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="time every tile configuration per shape")
    parser.add_argument("--kwarps", action="store_true", help="--sweep also tries K over the warps of each tile")
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS, help="row counts to time (default 2 16)")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows_out, frame_ms, best = [], {"torch": 0.0, "skinny": 0.0}, {}
    for name, n, k, per_frame, gated in SHAPES:
        reference, ours = (gated_silu_reference, skinny_gated_silu) if gated else (F.linear, skinny_linear)
        copies = max(2, CYCLE_BYTES // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        floor_us = n * k * 2 / copy_bandwidth() * 1e6
        x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        invariant = torch.equal(ours(x16, weights[0])[:2], ours(x16[:2].clone(), weights[0]))
        for rows in args.rows:
            x = x16[:rows].contiguous()
            ref = reference(x, weights[0]).float()
            err = ((ours(x, weights[0]).float() - ref).abs().max() / ref.abs().max()).item()
            torch_us, ours_us = (per_call_ms(fn, x, weights) * 1e3 for fn in (reference, ours))
            if rows == 2:
                frame_ms["torch"] += per_frame * torch_us / 1e3
                frame_ms["skinny"] += per_frame * ours_us / 1e3
            config = "gated" if gated else str(tile_config(n, k))
            rows_out.append([name, n, k, rows, floor_us, torch_us, floor_us / torch_us, ours_us, floor_us / ours_us,
                             config, f"{err:.1e}", invariant])
            if args.sweep:
                timed = []
                for config in configs(args.kwarps):
                    kernel = lambda a, b, c=config: run_kernel(a, b, c, gated=gated)  # noqa: E731
                    try:
                        timed.append((per_call_ms(kernel, x, weights) * 1e3, config))
                    except Exception as exc:  # a configuration the compiler rejects (shared memory, registers)
                        print(f"{name} {config}: {type(exc).__name__}")
                best[(name, rows)] = sorted(timed)[:3]
        del weights
    headers = ["shape", "N", "K", "rows", "floor us", "torch ops us", "torch x BW", "skinny us", "skinny x BW",
               "config", "rel err", "rows 0-1 of 16 == 2 rows"]
    print(table(headers, rows_out))
    print(f"\nMatmuls of one song's frame (2 rows, calls x per-call time): torch ops {frame_ms['torch']:.2f} ms, "
          f"skinny {frame_ms['skinny']:.2f} ms")
    for (name, rows), top in best.items():
        print(f"best {name} rows {rows}: " + ", ".join(f"{us:.2f} us {cfg}" for us, cfg in top))


if __name__ == "__main__":
    main()
