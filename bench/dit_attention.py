"""The DiT's attention alone (16 sequences of 690 tokens, 32 heads of 64 at eight windows): torch's SDPA (cuDNN) on
split_rope's strided views plus the copy into the o projection's layout, as the DiT ran it before, against our
Triton kernel (kernels/dit_attention.py) over a sweep of tiles. Graph replay, median of 20; max abs error of each
against float32 SDPA (TF32 off) on the same inputs.

    PYTHONPATH=src python3 bench/dit_attention.py
"""

from __future__ import annotations

import torch

from music3serve import contract
from music3serve.bench.common import graphed, table, time_ms
from music3serve.kernels.dit_attention import DEFAULT_CONFIG, dit_attention, dit_attention_reference

HEADS, HEAD_DIM = 32, 64
CONFIGS = [  # BLOCK_M, BLOCK_N, num_warps, num_stages
    (128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 5),
    (64, 64, 8, 3), (64, 64, 2, 3), (64, 32, 4, 4), (64, 32, 2, 3), (32, 64, 4, 3), (32, 64, 2, 3), (32, 32, 2, 3),
]


def attention_flops(batch: int, tokens: int) -> float:
    return 4.0 * batch * HEADS * tokens * tokens * HEAD_DIM


@torch.inference_mode()
def main() -> None:
    tokens = contract.latent_length(contract.WINDOW_FRAMES) + 1
    rows = []
    for windows in (1, 8):
        batch = 2 * windows
        qkv = torch.randn(batch, tokens, 3 * HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.view(batch, tokens, 3, HEADS, HEAD_DIM).unbind(2)
        torch.backends.cuda.matmul.allow_tf32 = False
        exact = dit_attention_reference(q.float(), k.float(), v.float())
        candidates = [("sdpa + layout copy", lambda: dit_attention_reference(q, k, v))]
        candidates += [(f"ours {c}" + (" (default)" if c == DEFAULT_CONFIG else ""),
                        lambda c=c: dit_attention(q, k, v, config=c)) for c in CONFIGS]
        for name, fn in candidates:
            try:
                err = (fn().float() - exact).abs().max().item()
                us = time_ms(graphed(fn)) * 1e3
            except Exception as exc:  # a tile the compiler refuses (shared memory): reported, not fatal
                print(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
                continue
            rows.append([name, windows, us, attention_flops(batch, tokens) / us / 1e6, f"{err:.1e}"])
            print(table(["kernel", "windows", "us per layer", "TFLOP/s", "max abs err vs fp32"], rows[-1:]), flush=True)
    print(table(["kernel", "windows", "us per layer", "TFLOP/s", "max abs err vs fp32"], rows))


if __name__ == "__main__":
    main()
