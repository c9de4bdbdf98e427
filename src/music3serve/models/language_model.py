"""Qwen3 decoder-only backbone of the talker, with fused QKV and gate/up projections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .. import contract
from ..errors import CheckpointError
from .fusion import hot
from .layers import (
    GatedMLP, RMSNorm, Weight, apply_rope, as_tokens, linear, normed, residual_mlp, rms_norm, rope_angles,
)
from .weights import Source, require


@dataclass(frozen=True)
class LanguageModelConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    eps: float
    rope_theta: float
    vocab: int
    max_positions: int

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> "LanguageModelConfig":
        rope = cfg.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise CheckpointError(f"'rope_parameters' must be a JSON object, got {rope!r:.80}")
        theta = cfg.get("rope_theta", rope.get("rope_theta"))
        return cls(
            hidden=require(cfg, "hidden_size"),
            layers=require(cfg, "num_hidden_layers"),
            heads=require(cfg, "num_attention_heads"),
            kv_heads=require(cfg, "num_key_value_heads"),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            mlp=require(cfg, "intermediate_size"),
            eps=require(cfg, "rms_norm_eps"),
            rope_theta=require({"rope_theta": theta}, "rope_theta"),
            vocab=require(cfg, "vocab_size"),
            max_positions=require(cfg, "max_position_embeddings"),
        )


class QKTransform(NamedTuple):
    """What turns a layer's q and k projections into attention inputs: per-head RMS norm weights and eps, then RoPE
    by cos and sin (float32, as rope_angles gives them: [rows, t, head_dim] or [t, head_dim])."""

    q_norm: torch.Tensor
    k_norm: torch.Tensor
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor


class AttentionBackend(Protocol):
    """Stores a layer's new keys/values and attends: q [b, t, heads, d], k/v [b, t, kv_heads, d] -> [b, t, heads * d].
    With `takes_projections`, q and k arrive as projections with the QKTransform to apply (one token per row)."""

    takes_projections: bool

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, transform: QKTransform | None = None
    ) -> torch.Tensor: ...


class KVCache:
    """Dense per-row key/value storage [layers, rows, kv_heads, capacity, head_dim] for rows that advance together."""

    takes_projections = False

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v, self.start = k, v, 0

    @classmethod
    def allocate(
        cls, cfg: LanguageModelConfig, rows: int, capacity: int, dtype: torch.dtype, device: torch.device | str
    ) -> "KVCache":
        shape = (cfg.layers, rows, cfg.kv_heads, capacity, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def at(self, start: int) -> "KVCache":
        """This cache, with the next inputs placed at positions start, start + 1, ..."""
        self.start = start
        return self

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, transform: None = None
    ) -> torch.Tensor:
        if transform is not None:
            raise ValueError("KVCache takes attention inputs, not projections (takes_projections is False)")
        b, t = q.shape[:2]
        start, end = self.start, self.start + t
        self.k[layer, :, :, start:end] = k.transpose(1, 2)
        self.v[layer, :, :, start:end] = v.transpose(1, 2)
        keys, values = self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        mask = None
        if t > 1 and start > 0:  # a later chunk: causal within itself, full view of what came before
            mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
        causal = t > 1 and start == 0  # lets SDPA pick a flash kernel instead of materializing a mask
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(b, t, -1)


class Attention(nn.Module):
    def __init__(self, cfg: LanguageModelConfig):
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, q + 2 * kv, bias=False)
        self.o = nn.Linear(q, cfg.hidden, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.eps)

    def inputs(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated, normed queries and keys [rows, t, heads, head_dim], and values, of already-normed inputs x
        [rows * t, 1, hidden] (as_tokens) with rope's angles for [t] or [rows, t] positions."""
        cos, sin = (as_tokens(angles.expand(rows, -1, -1) if angles.dim() == 2 else angles).contiguous()
                    for angles in rope)
        q, k, v = attention_inputs(
            x, self.qkv.weight, self.q_norm.weight, self.k_norm.weight, cos, sin, self.cfg.eps, self.cfg.heads,
            self.cfg.kv_heads,
        )
        return tuple(p.view(rows, -1, *p.shape[2:]) for p in (q, k, v))  # type: ignore[return-value]


def projections(
    x: torch.Tensor, qkv_w: Weight, heads: int, kv_heads: int, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [b, t, heads, head_dim], k and v [b, t, kv_heads, head_dim] of already-normed inputs, as projected."""
    b, t, _ = x.shape
    q, k, v = linear(x, qkv_w).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(b, t, heads, head_dim), k.view(b, t, kv_heads, head_dim), v.view(b, t, kv_heads, head_dim)


@hot
def attention_inputs(
    x: torch.Tensor, qkv_w: Weight, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, eps: float, heads: int, kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = projections(x, qkv_w, heads, kv_heads, q_norm_w.shape[0])
    return apply_rope(rms_norm(q, q_norm_w, eps), cos, sin), apply_rope(rms_norm(k, k_norm_w, eps), cos, sin), v


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LanguageModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = GatedMLP(cfg.hidden, cfg.mlp)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attend: AttentionBackend, layer: int,
    ) -> torch.Tensor:
        eps, cfg = self.attn.cfg.eps, self.attn.cfg
        tokens = as_tokens(x)
        h = normed(tokens, self.attn_norm.weight, eps)
        if getattr(attend, "takes_projections", False):
            transform = QKTransform(self.attn.q_norm.weight, self.attn.k_norm.weight, eps, *rope)
            attn_out = attend(layer, *projections(h.view(x.shape), self.attn.qkv.weight, cfg.heads, cfg.kv_heads,
                                                  cfg.head_dim), transform)
        else:
            attn_out = attend(layer, *self.attn.inputs(h, rope, x.shape[0]))
        return residual_mlp(
            tokens, as_tokens(attn_out), self.attn.o.weight, self.mlp_norm.weight, self.mlp.gate_up.weight,
            self.mlp.down.weight, eps,
        ).view(x.shape)


class LanguageModel(nn.Module):
    """Qwen3ForCausalLM math; the head keeps only the 16385 legal rows (audio_end, then the codes)."""

    def __init__(self, cfg: LanguageModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.head = nn.Linear(cfg.hidden, contract.LEGAL_COLUMNS, bias=False)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attend: AttentionBackend) -> torch.Tensor:
        """Final-normed hidden states [rows, t, hidden] of inputs at `positions` ([t] or [rows, t])."""
        rope = rope_angles(positions, self.cfg.head_dim, self.cfg.rope_theta)
        x = embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, attend, index)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """float32 logits over the legal columns: column 0 is audio_end, column 1 + k is code k. widen=False: in the
        head's dtype, for a sampler that widens them itself (inside its fused kernels; the values are the same)."""
        logits = linear(hidden, self.head.weight)
        return logits.float() if widen else logits

    @staticmethod
    def checkpoint_sources(cfg: LanguageModelConfig) -> dict[str, list[Source]]:
        """Where each of our parameters comes from in the transformers Qwen3ForCausalLM layout."""
        h, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        sources: dict[str, list[Source]] = {
            "embed.weight": [Source("model.embed_tokens.weight", (cfg.vocab, h))],
            "norm.weight": [Source("model.norm.weight", (h,))],
            "head.weight": [
                Source("lm_head.weight", (cfg.vocab, h), rows=(contract.AUDIO_END, contract.AUDIO_END + 1)),
                Source(
                    "lm_head.weight",
                    (cfg.vocab, h),
                    rows=(contract.AUDIO_CODE_OFFSET, contract.AUDIO_CODE_OFFSET + contract.SEMANTIC_CODES),
                ),
            ],
        }
        for i in range(cfg.layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            sources[dst + "attn_norm.weight"] = [Source(src + "input_layernorm.weight", (h,))]
            sources[dst + "mlp_norm.weight"] = [Source(src + "post_attention_layernorm.weight", (h,))]
            sources[dst + "attn.qkv.weight"] = [
                Source(src + "self_attn.q_proj.weight", (q, h)),
                Source(src + "self_attn.k_proj.weight", (kv, h)),
                Source(src + "self_attn.v_proj.weight", (kv, h)),
            ]
            sources[dst + "attn.o.weight"] = [Source(src + "self_attn.o_proj.weight", (h, q))]
            sources[dst + "attn.q_norm.weight"] = [Source(src + "self_attn.q_norm.weight", (cfg.head_dim,))]
            sources[dst + "attn.k_norm.weight"] = [Source(src + "self_attn.k_norm.weight", (cfg.head_dim,))]
            sources[dst + "mlp.gate_up.weight"] = [
                Source(src + "mlp.gate_proj.weight", (cfg.mlp, h)),
                Source(src + "mlp.up_proj.weight", (cfg.mlp, h)),
            ]
            sources[dst + "mlp.down.weight"] = [Source(src + "mlp.down_proj.weight", (h, cfg.mlp))]
        return sources
