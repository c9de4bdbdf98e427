"""Building blocks shared by our model implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.skinny_linear import gated_silu_reference, skinny_gated_silu, skinny_linear
from .fp8 import Fp8Weight, reference_linear
from .fusion import hot


class RMSNorm(nn.Module):
    """RMS norm with float32 statistics; the result is cast to the weight dtype before scaling."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normed(as_tokens(x), self.weight, self.eps).view(x.shape)


def as_tokens(x: torch.Tensor) -> torch.Tensor:
    """[..., width] -> [tokens, 1, width]: every token a row of its own. The per-token hot paths take this shape, so a
    decode step's rows and a prefill chunk's tokens run one compiled graph (before torch 2.13 a size of one compiles
    graphs of its own, models/fusion.py)."""
    return x.reshape(-1, 1, x.shape[-1])


@hot
def normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm as a hot path: one fused kernel once fusion is enabled (the models' final norms, each layer's
    input norm)."""
    return rms_norm(x, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(weight.dtype)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused into one matmul."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_up.weight, self.down.weight)


Weight = torch.Tensor | Fp8Weight  # an FP8 weight multiplies weight-only: x keeps its dtype (models/fp8.py)


def linear(x: torch.Tensor, weight: Weight, residual: torch.Tensor | None = None) -> torch.Tensor:
    """[residual +] F.linear(x, weight) without bias; on CUDA, bf16 decode rows take the skinny kernel, the residual
    added in its epilogue (kernels/skinny_linear.py)."""
    if isinstance(weight, Fp8Weight):
        if _skinny(x):
            return skinny_linear(x, weight.codes, residual, weight.scale)
        return reference_linear(x, weight) if residual is None else residual + reference_linear(x, weight)
    if _skinny(x):
        return skinny_linear(x, weight, residual)
    return F.linear(x, weight) if residual is None else residual + F.linear(x, weight)


def swiglu(x: torch.Tensor, gate_up: Weight, down: Weight, residual: torch.Tensor | None = None) -> torch.Tensor:
    """[residual +] down(silu(gate) * up) with gate_up = [gate | up]; on CUDA bf16 two skinny kernels."""
    gated = skinny_gated_silu if _skinny(x) else gated_silu_reference
    if isinstance(gate_up, Fp8Weight):
        return linear(gated(x, gate_up.codes, gate_up.scale), down, residual)
    return linear(gated(x, gate_up), down, residual)


@hot
def residual_mlp(
    x: torch.Tensor, attn_out: torch.Tensor, o_w: Weight, norm_w: torch.Tensor, gate_up_w: Weight, down_w: Weight,
    eps: float,
) -> torch.Tensor:
    """x + o(attn_out), then + SwiGLU(norm(.)): the second half of a pre-norm decoder block (backbone and depth
    decoder)."""
    x = linear(attn_out, o_w, residual=x)
    return swiglu(rms_norm(x, norm_w, eps), gate_up_w, down_w, residual=x)


def _skinny(x: torch.Tensor) -> bool:
    """CUDA bf16 inputs go to the skinny custom ops (which fall back to torch for many rows); anything else stays
    plain torch ops that inductor can fuse."""
    return x.is_cuda and x.dtype == torch.bfloat16


def rope_angles(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [..., rotary_dim] for integer positions (the half-split convention)."""
    exponents = torch.arange(0, rotary_dim, 2, device=positions.device).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = positions.float()[..., None] * inv_freq
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x (layout [..., heads, head_dim]; cos is [..., rot])."""
    rot = cos.shape[-1]
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    head, tail = x[..., :rot], x[..., rot:]
    first, second = head.chunk(2, dim=-1)
    rotated = head * cos + torch.cat((-second, first), dim=-1) * sin
    return rotated if tail.shape[-1] == 0 else torch.cat((rotated, tail), dim=-1)
