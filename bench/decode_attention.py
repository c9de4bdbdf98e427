"""Decode attention tuning: `music3serve bench talker` prints the kernel against full-cache SDPA and the floor
(music3serve/bench/attention.py); this script adds the eager time, the error against the reference, and with
--sweep other block sizes / warps / stages / split counts (graph replay, per layer).

    PYTHONPATH=src python3 bench/decode_attention.py [--sweep]
"""

from __future__ import annotations

import argparse
import math

import torch

from music3serve.bench.attention import CAPACITY, LAYERS, AttentionCase
from music3serve.bench.attention import run as table_run
from music3serve.bench.common import graphed, time_ms
from music3serve.kernels.decode_attention import (
    _BLOCK_N,
    _choose_num_splits,
    _decode_attention_triton,
    decode_attention,
)
from music3serve.kernels.decode_attention_reference import decode_attention_reference

FILLED = (1024, 5120, 10240)
ROWS = (2, 16)


def per_layer_us(fn) -> float:
    return time_ms(fn) * 1e3 / LAYERS


def tuned(case: AttentionCase, **kw):
    return lambda: [_decode_attention_triton(case.q[i], case.k[i], case.v[i], case.lengths, **kw) for i in range(LAYERS)]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time other block sizes / warps / stages / splits")
    args = parser.parse_args()
    print(table_run(ROWS, FILLED))
    for rows in ROWS:
        case = AttentionCase(rows)
        for n in FILLED:
            case.set_length(n)
            out = decode_attention(case.q[0], case.k[0], case.v[0], case.lengths).float()
            ref = decode_attention_reference(case.q[0].float(), case.k[0], case.v[0], case.lengths)
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            print(f"rows {rows} filled {n}: eager {per_layer_us(case.ours):.2f} us per layer, rel err {err:.1e}")
            if not args.sweep:
                continue
            results = []
            for block_n in (32, 64, 128):
                for num_warps in (4, 8):
                    for num_stages in (2, 3, 4):
                        splits = _choose_num_splits(CAPACITY, block_n)
                        kw = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, num_splits=splits)
                        try:
                            results.append((per_layer_us(graphed(tuned(case, **kw))), kw))
                        except Exception as e:  # e.g. out of shared memory
                            print(f"  {kw}: {type(e).__name__}: {str(e)[:100]}")
            base = _choose_num_splits(CAPACITY, _BLOCK_N)
            for mult in (0.25, 0.5, 2, 4):
                kw = dict(num_splits=max(1, int(base * mult)))
                results.append((per_layer_us(graphed(tuned(case, **kw))), kw))
            best = sorted((r for r in results if not math.isnan(r[0])), key=lambda r: r[0])[:6]
            print("  best: " + "; ".join(f"{t:.2f} {kw}" for t, kw in best))
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
