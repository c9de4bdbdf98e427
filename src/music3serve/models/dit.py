"""Flow-matching DiT: [latent, zeros, condition] stem, a time token, 36 LayerNorm blocks, partial RoPE."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.add_layer_norm import add_layer_norm, add_layer_norm_fp8, add_layer_norm_reference
from ..kernels.add_layer_norm import uses_kernel as uses_add_norm_kernel
from ..kernels.dit_attention import dit_attention
from ..kernels.glu_linear import glu, glu_linear, pair_rows, unpair_rows
from ..kernels.glu_linear import uses_kernel as uses_glu_kernel
from ..kernels.row_quant import fp8_rows
from ..kernels.split_rope import split_rope
from .fp8 import Fp8Rows, Fp8Weight, quantize_rows, scaled_linear
from .fusion import between_library_calls, hot
from .layers import Weight, rope_angles
from .weights import Source, require

ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class DiTConfig:
    channels: int
    condition: int
    layers: int
    heads: int
    head_dim: int
    ff: int
    rotary_dim: int
    fourier: int

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    @property
    def stem(self) -> int:
        return 2 * self.channels + self.condition

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> "DiTConfig":
        return cls(
            channels=require(cfg, "in_channels"),
            condition=require(cfg, "condition_dim"),
            layers=require(cfg, "num_layers"),
            heads=require(cfg, "num_attention_heads"),
            head_dim=require(cfg, "attention_head_dim"),
            ff=require(cfg, "ff_inner_dim"),
            rotary_dim=require(cfg, "rotary_dim"),
            fourier=require(cfg, "fourier_embedding_dim"),
        )


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.o = nn.Linear(cfg.width, cfg.width, bias=False)
        self.norm2 = nn.LayerNorm(cfg.width)
        self.ff_in = nn.Linear(cfg.width, 2 * cfg.ff)
        self.ff_out = nn.Linear(cfg.ff, cfg.width)
        self.glu_pairs = False  # ff_in's rows: [value; gate] halves as in the checkpoint, or pairs (set_glu_pairs)
        # State dicts hold the checkpoint's order whatever the rows' order in memory.
        self.register_state_dict_post_hook(_ff_in_rows_saved_in_checkpoint_order)
        self.register_load_state_dict_pre_hook(_ff_in_rows_loaded_in_block_order)

    def set_glu_pairs(self, pairs: bool) -> None:
        """Put ff_in's rows (in place) in the (gate, value) pairs that kernels/glu_linear.py fuses, or back in the
        checkpoint's [value; gate] halves."""
        if pairs != self.glu_pairs:
            reorder = pair_rows if pairs else unpair_rows
            self.ff_in.weight.data = reorder(self.ff_in.weight.data)
            self.ff_in.bias.data = reorder(self.ff_in.bias.data)
            self.glu_pairs = pairs

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on the residual stream x + delta (delta: the previous block's feed-forward output, zeros for the
        first block). Returns (stream + attention, this block's feed-forward output): the sum is left to the next
        block, whose norm it joins in one kernel, or to the caller after the last block."""
        # Decided here, outside the compiled hot paths, so they specialize on it (and fuse the torch ops if False).
        kernel1 = uses_add_norm_kernel(x, self.norm1.weight, self.norm1.bias, self.qkv.weight.dtype)
        kernel2 = uses_add_norm_kernel(x, self.norm2.weight, self.norm2.bias, self.ff_in.weight.dtype)
        fused_glu = self.glu_pairs and not isinstance(self.ff_in.weight, Fp8Weight) and uses_glu_kernel(
            x.numel() // x.shape[-1], self.ff_in.weight, self.ff_in.bias)
        x, qkv = dit_qkv(x, delta, self.norm1.weight, self.norm1.bias, self.qkv.weight, self.norm1.eps, kernel1)
        q, k, v = split_rope(qkv, *rope, self.heads)
        return dit_block_output(
            x, dit_attention(q, k, v), self.o.weight, self.norm2.weight, self.norm2.bias, self.ff_in.weight,
            self.ff_in.bias, self.ff_out.weight, self.ff_out.bias, self.norm2.eps, kernel2, self.glu_pairs, fused_glu,
        )


FF_IN = ("ff_in.weight", "ff_in.bias")


def _ff_in_rows_saved_in_checkpoint_order(block: DiTBlock, state_dict: dict, prefix: str, _metadata: object) -> None:
    if block.glu_pairs:
        for name in FF_IN:
            if prefix + name in state_dict:  # an FP8 ff_in holds codes and scales instead (models/fp8.py)
                state_dict[prefix + name] = unpair_rows(state_dict[prefix + name])


def _ff_in_rows_loaded_in_block_order(block: DiTBlock, state_dict: dict, prefix: str, *_args) -> None:
    if block.glu_pairs:
        for name in FF_IN:
            if prefix + name in state_dict:
                state_dict[prefix + name] = pair_rows(state_dict[prefix + name])


# Each layer reads its input in its own weight dtype, so float32 islands (acoustic/precision.py) compute on
# upcast inputs, and the residual stream keeps x's dtype.
@between_library_calls
@hot
def dit_qkv(
    x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, norm_b: torch.Tensor, qkv_w: torch.Tensor,
    eps: float, kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block input x + delta [batch, tokens, width], and the fused q, k, v projections of its norm."""
    x, h = add_norm(x, delta, norm_w, norm_b, eps, qkv_w, kernel)
    return x, block_linear(h, qkv_w)


@between_library_calls
@hot
def dit_block_output(
    x: torch.Tensor, attn: torch.Tensor, o_w: Weight, norm_w: torch.Tensor, norm_b: torch.Tensor, ff_in_w: Weight,
    ff_in_b: torch.Tensor | None, ff_out_w: Weight, ff_out_b: torch.Tensor | None, eps: float, kernel: bool,
    pairs: bool, fused_glu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x + o(attn), and the GLU feed-forward of its norm (not yet added); attn is [batch, tokens, width]. `pairs`:
    ff_in's rows are in (gate, value) pairs; `fused_glu`: glu_linear's fused GEMM takes them."""
    attn_out = block_linear(attn.to(o_w.dtype), o_w)
    x, h = add_norm(x, attn_out, norm_w, norm_b, eps, ff_in_w, kernel)
    act = glu_linear(h, ff_in_w, ff_in_b) if fused_glu else glu(block_linear(h, ff_in_w, ff_in_b), pairs)
    # An FP8 ff_out's input is cast here, where inductor fuses the cast with the bias and the gate.
    act = quantize_rows(act) if isinstance(ff_out_w, Fp8Weight) else act.to(ff_out_w.dtype)
    return x, block_linear(act, ff_out_w, ff_out_b)


def block_linear(x: torch.Tensor | Fp8Rows, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or for an FP8 weight the FP8 GEMM with x cast to e4m3 per token (models/fp8.py), unless it is."""
    if isinstance(weight, Fp8Weight):
        return scaled_linear(x if isinstance(x, Fp8Rows) else fp8_rows(x), weight, bias)
    return F.linear(x, weight, bias)


def add_norm(
    x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, norm_b: torch.Tensor, eps: float,
    next_w: Weight, kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
    """(x + delta, its layer norm as the next GEMM's weight next_w takes it): the one-pass kernel (casting to e4m3
    in the same pass for an FP8 weight), or the torch ops for inductor to fuse."""
    if kernel and isinstance(next_w, Fp8Weight):
        return add_layer_norm_fp8(x, delta, norm_w, norm_b, eps)
    if kernel:
        return add_layer_norm(x, delta, norm_w, norm_b, eps, next_w.dtype)
    return add_layer_norm_reference(x, delta, norm_w, norm_b, eps, next_w.dtype)


class DiT(nn.Module):
    """Predicts the flow-matching velocity of latents [batch, channels, length] (t = 0 noise, 1 data)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.fourier = nn.Parameter(torch.empty(cfg.fourier // 2, 1))
        self.time_in = nn.Linear(cfg.fourier, cfg.width)
        self.time_out = nn.Linear(cfg.width, cfg.width)
        self.stem = nn.Linear(cfg.stem, cfg.stem, bias=False)
        self.proj_in = nn.Linear(cfg.stem, cfg.width, bias=False)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.layers))
        self.proj_out = nn.Linear(cfg.width, cfg.channels, bias=False)
        self.post = nn.Linear(cfg.channels, cfg.channels, bias=False)

    def time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        angles = 2.0 * math.pi * t.float()[:, None] @ self.fourier.float().T
        features = torch.cat((angles.cos(), angles.sin()), dim=-1).to(self.time_in.weight.dtype)
        return self.time_out(F.silu(self.time_in(features)))

    def forward(self, latents: torch.Tensor, t: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        x = torch.cat((latents.transpose(1, 2), torch.zeros_like(latents.transpose(1, 2)), condition), dim=-1)
        x = self.proj_in(self.stem(x) + x)
        x = torch.cat((self.time_embedding(t)[:, None], x), dim=1)
        positions = torch.arange(x.shape[1], device=x.device)
        rope = rope_angles(positions, self.cfg.rotary_dim, ROPE_THETA)
        # The first block adds zeros in the dtype the others' deltas have (x + 0 is x): one compiled graph serves all.
        delta = torch.zeros_like(x, dtype=self.blocks[0].ff_out.weight.dtype) if self.blocks else None
        for block in self.blocks:
            x, delta = block(x, delta, rope)
        x = x if delta is None else x + delta
        out = self.proj_out(x[:, 1:])
        return (self.post(out) + out).transpose(1, 2)

    @staticmethod
    def checkpoint_sources(cfg: DiTConfig) -> dict[str, list[Source]]:
        """Where each of our parameters comes from in the diffusers layout (1x1 convs read as linears)."""
        w = cfg.width
        sources: dict[str, list[Source]] = {
            "fourier": [Source("time_proj.weight", (cfg.fourier // 2, 1))],
            "time_in.weight": [Source("time_embed.linear_1.weight", (w, cfg.fourier))],
            "time_in.bias": [Source("time_embed.linear_1.bias", (w,))],
            "time_out.weight": [Source("time_embed.linear_2.weight", (w, w))],
            "time_out.bias": [Source("time_embed.linear_2.bias", (w,))],
            "stem.weight": [Source("preprocess_conv.weight", (cfg.stem, cfg.stem, 1))],
            "proj_in.weight": [Source("proj_in.weight", (w, cfg.stem))],
            "proj_out.weight": [Source("proj_out.weight", (cfg.channels, w))],
            "post.weight": [Source("postprocess_conv.weight", (cfg.channels, cfg.channels, 1))],
        }
        for i in range(cfg.layers):
            p = f"transformer_blocks.{i}."
            d = f"blocks.{i}."
            for norm in ("norm1", "norm2"):
                sources[d + norm + ".weight"] = [Source(p + norm + ".weight", (w,))]
                sources[d + norm + ".bias"] = [Source(p + norm + ".bias", (w,))]
            sources[d + "qkv.weight"] = [Source(p + f"attn.to_{n}.weight", (w, w)) for n in "qkv"]
            sources[d + "o.weight"] = [Source(p + "attn.to_out.0.weight", (w, w))]
            sources[d + "ff_in.weight"] = [Source(p + "ff_in.weight", (2 * cfg.ff, w))]
            sources[d + "ff_in.bias"] = [Source(p + "ff_in.bias", (2 * cfg.ff,))]
            sources[d + "ff_out.weight"] = [Source(p + "ff_out.weight", (w, cfg.ff))]
            sources[d + "ff_out.bias"] = [Source(p + "ff_out.bias", (w,))]
        return sources
