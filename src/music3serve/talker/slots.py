"""KV slots of the talker: one pair of rows (cond, uncond) per song, active pairs packed at the front.

Storage is [layers, rows, kv_heads, capacity, head_dim]. Pair p owns rows 2p and 2p + 1. Songs that are
decoding occupy pairs 0..active-1, so a decode step always works on the prefix of rows [0, 2 * active)
and never gathers the cache; a song that leaves is replaced by the last active pair (its filled rows are
copied). One extra position per row past max_model_len is scratch for padded rows of a captured step.
"""

from __future__ import annotations

import torch

from ..errors import Music3Error
from ..kernels.decode_attention import decode_attention, takes_rotation
from ..models.language_model import KVCache, LanguageModelConfig, QKTransform


class SlotCache:
    def __init__(
        self, cfg: LanguageModelConfig, pairs: int, max_model_len: int, dtype: torch.dtype, device: torch.device | str
    ):
        self.cfg, self.pairs = cfg, pairs
        self.scratch = max_model_len  # position written by padded rows
        shape = (cfg.layers, 2 * pairs, cfg.kv_heads, max_model_len + 1, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_needed(cfg: LanguageModelConfig, pairs: int, max_model_len: int, dtype: torch.dtype) -> int:
        elements = 2 * cfg.layers * 2 * pairs * cfg.kv_heads * (max_model_len + 1) * cfg.head_dim
        return elements * torch.empty((), dtype=dtype).element_size()

    def prefill(self, pair: int, start: int) -> KVCache:
        """Attention backend writing the pair's rows at positions start.. and attending causally over [0, end)."""
        rows = slice(2 * pair, 2 * pair + 2)
        return KVCache(self.k[:, rows], self.v[:, rows]).at(start)

    def decode(self, rows: int, positions: torch.Tensor) -> "DecodeRows":
        return DecodeRows(self, rows, positions)

    def move_pair(self, source: int, target: int, filled: int) -> None:
        """Copy the first `filled` positions of pair `source` into pair `target`."""
        src, dst = slice(2 * source, 2 * source + 2), slice(2 * target, 2 * target + 2)
        self.k[:, dst, :, :filled] = self.k[:, src, :, :filled]
        self.v[:, dst, :, :filled] = self.v[:, src, :, :filled]


class DecodeRows:
    """Attention backend for one new token on rows [0, rows), each at its own position (a device tensor)."""

    def __init__(self, slots: SlotCache, rows: int, positions: torch.Tensor):
        self.slots, self.rows = slots, rows
        self.positions = positions[:rows]
        # Padded rows (at the scratch position) attend to one position only: their output is discarded.
        self.lengths = torch.where(self.positions >= slots.scratch, 1, self.positions + 1)
        # On CUDA the attention kernel norms and rotates q and the new key as it loads them (one kernel a layer less).
        self.takes_projections = takes_rotation(positions.device)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, transform: QKTransform | None = None
    ) -> torch.Tensor:
        if q.shape[1] != 1:
            raise Music3Error("decode attention takes exactly one new token per row")
        k_cache, v_cache = self.slots.k[layer, : self.rows], self.slots.v[layer, : self.rows]
        new = (k[:, 0], v[:, 0], self.positions)  # stored at each row's position by the attention kernel itself
        rotation = None
        if transform is not None:  # cos and sin [rows, 1, head_dim]: one position per row
            rotation = (transform.q_norm, transform.k_norm, transform.eps, transform.cos[:, 0], transform.sin[:, 0])
        out = decode_attention(q[:, 0], k_cache, v_cache, self.lengths, append=new, rotation=rotation)
        return out.reshape(self.rows, 1, -1)
