"""Decode attention at the talker's shapes: our kernel (filled rows only) against SDPA over the whole capacity.

36 layers (each with its own cache memory, as in a decode step) replayed from one CUDA graph, time / 36.
Floor: the filled K + V bytes at the device copy bandwidth."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.decode_attention import decode_attention
from .common import copy_bandwidth, graphed, table, time_ms

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 36, 32, 8, 128, 10240


class AttentionCase:
    """q and a full-capacity bf16 KV cache for `rows` rows, with a settable filled length."""

    def __init__(self, rows: int, device: str = "cuda"):
        self.rows, self.device = rows, device
        shape = (LAYERS, rows, KV_HEADS, CAPACITY, HEAD_DIM)
        self.k = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_()
        self.v = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_()
        self.q = torch.randn(LAYERS, rows, Q_HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
        self.lengths = torch.full((rows,), CAPACITY, device=device, dtype=torch.int32)
        self.mask = torch.ones(rows, 1, 1, CAPACITY, device=device, dtype=torch.bool)

    def set_length(self, filled: int) -> None:
        self.lengths.fill_(filled)
        self.mask.copy_((torch.arange(CAPACITY, device=self.device) < self.lengths[:, None])[:, None, None, :])

    def ours(self) -> list[torch.Tensor]:
        return [decode_attention(self.q[i], self.k[i], self.v[i], self.lengths) for i in range(LAYERS)]

    def full_cache_one(self, layer: int) -> torch.Tensor:
        """SDPA over the whole capacity, masked (GQA as a group-sized query per KV head)."""
        q = self.q[layer].view(self.rows, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
        out = F.scaled_dot_product_attention(q, self.k[layer], self.v[layer], attn_mask=self.mask)
        return out.reshape(self.rows, Q_HEADS, HEAD_DIM)

    def full_cache(self) -> list[torch.Tensor]:
        return [self.full_cache_one(i) for i in range(LAYERS)]

    def floor_us(self, filled: int) -> float:
        return self.rows * KV_HEADS * filled * HEAD_DIM * 2 * 2 / copy_bandwidth() * 1e6


@torch.inference_mode()
def run(rows=(2, 16), filled=(1024, 5120, 10240)) -> str:
    out = []
    for n_rows in rows:
        case = AttentionCase(n_rows)
        for n in filled:
            case.set_length(n)
            ours = time_ms(graphed(case.ours)) * 1e3 / LAYERS
            full = time_ms(graphed(case.full_cache)) * 1e3 / LAYERS
            floor = case.floor_us(n)
            out.append([n_rows, n, ours, full, floor, ours / floor, full / ours])
        del case
        torch.cuda.empty_cache()
    headers = ["rows", "filled", "ours us", "full-cache SDPA us", "floor us", "ours / floor", "full cache / ours"]
    return "decode attention per layer (36 layers in one graph / 36):\n\n" + table(headers, out)
