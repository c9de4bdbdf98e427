"""Split a fused QKV projection into per-head q, k, v with partial RoPE on q and k, in one pass over memory.

``qkv`` is [batch, tokens, 3 * heads * head_dim] (q, k, v concatenated on the last dim, the DiT's layout); the
first ``rotary_dim`` dims of every q and k head are rotated by the half-split convention of
``models.layers.apply_rope``, the rest pass through. Results are three contiguous [batch, tokens, heads, head_dim]
tensors in qkv's dtype.

On CUDA with Triton the work is one kernel (one program per token); it repeats the eager arithmetic rounding by
rounding (cos and sin cast to the dtype, each product and the sum rounded to it), yet on the H200 1.7% of bf16
elements differ from the torch ops, by an ulp of the products where they nearly cancel; both stay within the
dtype's rounding of the exact rotation (tests/test_split_rope.py). Elsewhere ``split_rope_reference`` runs the torch ops.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..models.layers import apply_rope
from .decode_attention import triton_available

__all__ = ["split_rope", "split_rope_reference"]


def split_rope_reference(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """The torch ops: chunk, view per head, apply_rope to q and k (cos, sin: [tokens, rotary_dim])."""
    b, t, _ = qkv.shape
    q, k, v = (p.reshape(b, t, heads, -1) for p in qkv.chunk(3, dim=-1))
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def split_rope(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v [batch, tokens, heads, head_dim] of qkv [batch, tokens, 3 * heads * head_dim], q and k rotated."""
    b, t, width3 = qkv.shape
    rot = cos.shape[-1]
    if width3 % (3 * heads) or cos.shape != (t, rot) or sin.shape != cos.shape or rot % 2:
        raise ValueError(f"split_rope: qkv {tuple(qkv.shape)} with {heads} heads and cos/sin "
                         f"{tuple(cos.shape)}/{tuple(sin.shape)} do not fit")
    head_dim = width3 // (3 * heads)
    if rot > head_dim:
        raise ValueError(f"split_rope: rotary dim {rot} exceeds head dim {head_dim}")
    if not (qkv.is_cuda and triton_available()):
        return split_rope_reference(qkv, cos, sin, heads)
    qkv = qkv.contiguous()
    out = torch.empty(3, b, t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    kernel = _kernel()
    kernel[(b * t,)](
        qkv, cos.float().contiguous(), sin.float().contiguous(), out, t, b * t * heads * head_dim,
        HEADS=heads, HEAD_DIM=head_dim, ROT=rot,
        BLOCK_H=_pow2(heads), BLOCK_D=_pow2(head_dim),
    )
    return out[0], out[1], out[2]


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _kernel():
    """Build the Triton kernel on first use (imports Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, tokens, plane,
                          HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0)  # b * tokens + t
        t = token % tokens
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < HEADS) & (d < HEAD_DIM)
        width = HEADS * HEAD_DIM
        half = ROT // 2
        rotated = d < ROT
        # Partner of dim d in the rotation: d + half in the first half (negated), d - half in the second.
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
        dtype = out_ptr.dtype.element_ty
        angle = t * ROT + tl.where(rotated, d, 0)
        cos = tl.load(cos_ptr + angle, mask=rotated, other=1.0).to(dtype).to(tl.float32)  # [1, BLOCK_D]
        sin = tl.load(sin_ptr + angle, mask=rotated, other=0.0).to(dtype).to(tl.float32)
        row = qkv_ptr + token * 3 * width
        dst = out_ptr + token * width + h * HEAD_DIM + d
        for part in tl.static_range(2):  # q, then k
            base = row + part * width + h * HEAD_DIM
            x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
            other = tl.load(base + partner, mask=mask & rotated, other=0.0).to(tl.float32)
            # apply_rope in the dtype: head * cos + cat(-second, first) * sin, each op rounded.
            a = (x * cos).to(dtype).to(tl.float32)
            c = ((sign * other).to(dtype).to(tl.float32) * sin).to(dtype).to(tl.float32)
            y = tl.where(rotated, (a + c).to(dtype), x.to(dtype))
            tl.store(dst + part * plane, y, mask=mask)
        v = tl.load(row + 2 * width + h * HEAD_DIM + d, mask=mask, other=0.0)
        tl.store(dst + 2 * plane, v, mask=mask)

    return split_rope_kernel
