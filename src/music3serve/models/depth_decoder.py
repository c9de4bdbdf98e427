"""RVQ depth decoder: four causal blocks over [global hidden, c0, c1, ...] with learned positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .fusion import hot
from .layers import GatedMLP, RMSNorm, linear, rms_norm, swiglu
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

    def forward(
        self, x: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return depth_block(
            x, past_k, past_v, self.attn_norm.weight, self.qkv.weight, self.o.weight, self.mlp_norm.weight,
            self.mlp.gate_up.weight, self.mlp.down.weight, self.attn_norm.eps, self.heads,
        )


@hot
def depth_block(x, past_k, past_v, attn_norm_w, qkv_w, o_w, mlp_norm_w, gate_up_w, down_w, eps: float, heads: int):
    """One causal depth-decoder block over the new positions x [rows, t, hidden] after the past ones (keys and
    values [rows, heads, past, head_dim]; past is 0, or t is 1). Returns x and the keys and values of all."""
    b, t, h = x.shape
    qkv = linear(rms_norm(x, attn_norm_w, eps), qkv_w)
    q, k, v = (p.view(b, t, heads, -1).transpose(1, 2) for p in qkv.chunk(3, dim=-1))
    if past_k.shape[2]:  # one new position after cached ones: it sees them all (a branch, not a SymBool flag)
        k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        attn = F.scaled_dot_product_attention(q, k, v)
    else:
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = linear(attn.transpose(1, 2).reshape(b, t, h), o_w, residual=x)
    return swiglu(rms_norm(x, mlp_norm_w, eps), gate_up_w, down_w, residual=x), k, v


class DepthKV:
    """Keys and values of the depth positions run so far in one frame, per block."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0


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

    def forward(self, projected: torch.Tensor, cache: DepthKV | None = None) -> torch.Tensor:
        """Normed hidden states [rows, t, hidden] of a projected depth sequence [rows, t, hidden]. With a cache,
        `projected` holds the positions after the cached ones (all of them, or one more) and the cache grows."""
        start = cache.length if cache is not None else 0
        if start and projected.shape[1] != 1:
            raise ValueError(f"a cached depth call takes one new position, got {projected.shape[1]}")
        x = projected + self.positions.weight[start : start + projected.shape[1]]
        rows, heads = x.shape[0], self.cfg.heads
        empty = x.new_zeros(rows, heads, 0, self.cfg.hidden // heads)
        keys, values = [], []
        for i, block in enumerate(self.blocks):
            past = (cache.keys[i], cache.values[i]) if start else (empty, empty)
            x, k, v = block(x, *past)
            keys.append(k)
            values.append(v)
        if cache is not None:
            cache.keys, cache.values = keys, values
        return self.norm(x)

    def head_logits(self, hidden: torch.Tensor, codebook: int) -> torch.Tensor:
        """float32 logits of residual codebook `codebook` (1..7) from hidden [rows, hidden]."""
        return linear(hidden, self.heads[codebook - 1]).float()

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The input projection of a depth position (backbone hidden state or code embedding)."""
        return linear(x, self.projection.weight)

    def embed_residual(self, codes: torch.Tensor, codebook: int) -> torch.Tensor:
        """Embedding of residual codes of codebook `codebook` (1..7)."""
        return self.embed(codes + (codebook - 1) * self.cfg.codes)

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
