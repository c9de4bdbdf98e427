"""RVQ depth decoder: four causal blocks over [global hidden, c0, c1, ...] with learned positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.decode_attention import decode_attention, takes_rotation
from .fusion import hot
from .layers import GatedMLP, RMSNorm, Weight, as_tokens, linear, residual_mlp, rms_norm
from .weights import Source, require


@dataclass(frozen=True)
class DepthDecoderConfig:
    hidden: int
    layers: int
    heads: int
    mlp: int
    codes: int
    codebooks: int
    positions: int

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> "DepthDecoderConfig":
        return cls(
            hidden=require(cfg, "hidden_size"),
            layers=require(cfg, "num_layers"),
            heads=require(cfg, "num_attention_heads"),
            mlp=require(cfg, "intermediate_size"),
            codes=require(cfg, "audio_vocab_size"),
            codebooks=require(cfg, "num_codebooks"),
            positions=require(cfg, "max_position_embeddings"),
        )


class DepthBlock(nn.Module):
    def __init__(self, cfg: DepthDecoderConfig):
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm = RMSNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.mlp = GatedMLP(cfg.hidden, cfg.mlp)

    def forward(self, x: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block over a whole depth sequence x [rows, t, hidden]; returns x and every position's keys and values
        [rows, heads, t, head_dim]. steps: DepthKV.steps (row p holds p in every column)."""
        b, t, h = x.shape
        qkv = depth_qkv(as_tokens(x), self.attn_norm.weight, self.qkv.weight, self.attn_norm.eps).view(b, t, -1)
        q, k, v = (p.view(b, t, self.heads, -1).transpose(1, 2) for p in qkv.chunk(3, dim=-1))
        attn = causal_attention(q, k, v, steps)
        x = residual_mlp(as_tokens(x), as_tokens(attn), self.o.weight, self.mlp_norm.weight, self.mlp.gate_up.weight,
                         self.mlp.down.weight, self.mlp_norm.eps)
        return x.view(b, t, h), k, v

    def decode(
        self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor,
        qkv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block for one new position x [rows, 1, hidden] over buffers of keys and values [rows, heads,
        capacity, head_dim]: decode attention stores the new key and value at `positions` and attends over
        [0, lengths). qkv: x's `qkv_of` if already known (looked up, not computed)."""
        if qkv is None:
            qkv = self.qkv_of(x)
        q, k, v = split_heads(qkv, self.heads)
        attn = decode_attention(q, keys, values, lengths, append=(k, v, positions))
        return residual_mlp(as_tokens(x), attn.reshape(-1, 1, x.shape[-1]), self.o.weight, self.mlp_norm.weight,
                            self.mlp.gate_up.weight, self.mlp.down.weight, self.mlp_norm.eps).view(x.shape)

    def qkv_of(self, x: torch.Tensor) -> torch.Tensor:
        """The normed projections [rows, 3 * hidden] of one new position x [rows, 1, hidden]: q | k | v."""
        return depth_qkv(as_tokens(x), self.attn_norm.weight, self.qkv.weight, self.attn_norm.eps).view(x.shape[0], -1)


@hot
def depth_qkv(x: torch.Tensor, attn_norm_w: torch.Tensor, qkv_w: Weight, eps: float) -> torch.Tensor:
    """q | k | v [tokens, 1, 3 * hidden] of tokens x [tokens, 1, hidden] (layers.as_tokens: one graph for every
    sequence length and row count)."""
    return linear(rms_norm(x, attn_norm_w, eps), qkv_w)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Causal attention [rows, t, heads * head_dim] of q, k, v [rows, heads, t, head_dim]. In bf16 where decode
    attention runs its Triton kernel (CUDA), position 0 is its own value (softmax over one key: exactly v) and each
    later position one launch of that kernel over the positions up to it (lengths from `steps`, DepthKV.steps), whose
    arithmetic per row does not depend on the other rows: SDPA's kernels follow the batch size, so a song's first
    depth call could round by the number of songs beside it. Elsewhere SDPA (float32: the kernel's dot products
    would round to TF32)."""
    b, heads, t, d = q.shape
    if q.dtype != torch.bfloat16 or not takes_rotation(q.device):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, heads * d)
    out = [v[:, :, 0]] + [decode_attention(q[:, :, j], k, v, steps[j + 1]) for j in range(1, t)]
    return torch.stack(out, dim=1).view(b, t, heads * d)


def split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [rows, heads, head_dim]: views of q | k | v [rows, 3 * hidden]."""
    return tuple(p.view(qkv.shape[0], heads, -1) for p in qkv.chunk(3, dim=-1))


class DepthKV:
    """Keys and values of the depth positions run so far in one frame, per block, in buffers of every position
    [rows, heads, capacity, head_dim]: the first call writes its positions there, and each later call runs decode
    attention, which stores the new position's key and value itself (kernels/decode_attention.py: on CUDA one Triton
    kernel per block, whose arithmetic per row does not depend on the rows beside it; its torch reference on the
    CPU)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0
        self.steps: torch.Tensor | None = None  # row p holds p in every column (lengths and positions)


class DepthDecoder(nn.Module):
    """Predicts residual codes c1..c7 of a frame; also owns their embedding table."""

    def __init__(self, cfg: DepthDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.codes * (cfg.codebooks - 1), cfg.hidden)
        self.projection = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.positions = nn.Embedding(cfg.positions, cfg.hidden)
        self.blocks = nn.ModuleList(DepthBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.heads = nn.Parameter(torch.empty(cfg.codebooks - 1, cfg.codes, cfg.hidden))

    def forward(
        self, projected: torch.Tensor, cache: DepthKV | None = None, positioned: bool = False,
        first_qkv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Normed hidden states [rows, t, hidden] of a projected depth sequence [rows, t, hidden]. With a cache,
        `projected` holds the positions after the cached ones (all of them, or one more) and the cache grows.
        positioned: `projected` already holds each position's embedding (added in its projection's epilogue).
        first_qkv: the new position's q | k | v in the first block (its `qkv_of`), known already (a cached call after
        the first only)."""
        start = cache.length if cache is not None else 0
        if start and projected.shape[1] != 1:
            raise ValueError(f"a cached depth call takes one new position, got {projected.shape[1]}")
        if first_qkv is not None and not start:
            raise ValueError("first_qkv is for a cached depth call after the first")
        x = projected if positioned else projected + self.positions.weight[start : start + projected.shape[1]]
        if start:
            lengths, positions = cache.steps[start + 1], cache.steps[start]
            for i, block in enumerate(self.blocks):
                x = block.decode(x, cache.keys[i], cache.values[i], lengths, positions, first_qkv if i == 0 else None)
            cache.length += 1
            return self.norm(x)
        keys, values = [], []
        steps = torch.arange(self.cfg.positions + 1, device=x.device)[:, None].expand(-1, x.shape[0]).contiguous()
        for block in self.blocks:
            x, k, v = block(x, steps)
            keys.append(k)
            values.append(v)
        if cache is not None:
            cache.keys, cache.values = self._buffered(keys), self._buffered(values)
            cache.length, cache.steps = projected.shape[1], steps
        return self.norm(x)

    def _buffered(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each [rows, heads, t, head_dim] at the start of a buffer of all positions."""
        out = []
        for t in tensors:
            buffer = t.new_empty(*t.shape[:2], self.cfg.positions, t.shape[3])
            buffer[:, :, : t.shape[2]] = t
            out.append(buffer)
        return out

    def head_logits(self, hidden: torch.Tensor, codebook: int, widen: bool = True) -> torch.Tensor:
        """float32 logits of residual codebook `codebook` (1..7) from hidden [rows, hidden] (widen=False: in the
        heads' dtype, as LanguageModel.logits)."""
        logits = linear(hidden, self.heads[codebook - 1])
        return logits.float() if widen else logits

    def code_row(self, codebook: int) -> int:
        """The embedding table's row of code 0 of residual codebook `codebook` (1..7)."""
        return (codebook - 1) * self.cfg.codes

    @staticmethod
    def checkpoint_sources(cfg: DepthDecoderConfig) -> dict[str, list[Source]]:
        """Where each of our parameters comes from in the diffusers layout."""
        h = cfg.hidden
        sources: dict[str, list[Source]] = {
            "embed.weight": [Source("audio_embeddings.weight", (cfg.codes * (cfg.codebooks - 1), h))],
            "projection.weight": [Source("projection.weight", (h, h))],
            "positions.weight": [Source("pos_embedding.weight", (cfg.positions, h))],
            "norm.weight": [Source("norm.weight", (h,))],
            "heads": [Source(f"audio_heads.{i}.weight", (cfg.codes, h)) for i in range(cfg.codebooks - 1)],
        }
        for i in range(cfg.layers):
            src, dst = f"layers.{i}.", f"blocks.{i}."
            sources[dst + "attn_norm.weight"] = [Source(src + "input_layernorm.weight", (h,))]
            sources[dst + "mlp_norm.weight"] = [Source(src + "post_attention_layernorm.weight", (h,))]
            sources[dst + "qkv.weight"] = [Source(src + f"attn.to_{n}.weight", (h, h)) for n in "qkv"]
            sources[dst + "o.weight"] = [Source(src + "attn.to_out.weight", (h, h))]
            sources[dst + "mlp.gate_up.weight"] = [
                Source(src + "gate_proj.weight", (cfg.mlp, h)),
                Source(src + "up_proj.weight", (cfg.mlp, h)),
            ]
            sources[dst + "mlp.down.weight"] = [Source(src + "down_proj.weight", (h, cfg.mlp))]
        return sources
