"""Per-head q, k, v of a fused QKV projection with partial RoPE on q and k, rotating in place.

``qkv`` is [batch, tokens, 3 * heads * head_dim] (q, k, v concatenated on the last dim, the DiT's layout); the
first ``rotary_dim`` dims of every q and k head are rotated by the half-split convention of
``models.layers.apply_rope``, the rest pass through. ``split_rope`` rotates those dims inside ``qkv`` and returns
q, k, v as [batch, tokens, heads, head_dim] views of it: only the rotated third of q and k is read and written
(a copy of all three, contiguous, cost ~0.3 ms per one-window DiT call, at copy bandwidth; attention reads the
strided views as they are).

On CUDA with Triton the rotation is one kernel (one program per token); it repeats the eager arithmetic rounding by
rounding (cos and sin cast to the dtype, each product and the sum rounded to it), yet on the H200 1.7% of bf16
elements differed from the torch ops (measured on the earlier copying kernel, same arithmetic), by an ulp of the
products where they nearly cancel; both stay within the dtype's rounding of the exact rotation
(tests/test_split_rope.py). Elsewhere the torch ops of ``split_rope_reference`` are written back into qkv.
"""

from __future__ import annotations

import functools

from torch import Tensor

from ..models.layers import apply_rope
from .decode_attention import triton_available

__all__ = ["split_rope", "split_rope_reference", "uses_kernel"]


def split_rope_reference(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """The torch ops: chunk, view per head, apply_rope to q and k (cos, sin: [tokens, rotary_dim])."""
    b, t, _ = qkv.shape
    q, k, v = (p.reshape(b, t, heads, -1) for p in qkv.chunk(3, dim=-1))
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def uses_kernel(qkv: Tensor) -> bool:
    """Whether split_rope rotates qkv with the Triton kernel (else the torch ops)."""
    return qkv.is_cuda and triton_available()


def split_rope(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v [batch, tokens, heads, head_dim]: views of qkv [batch, tokens, 3 * heads * head_dim] (contiguous),
    whose q and k it rotates in place."""
    b, t, width3 = qkv.shape
    rot = cos.shape[-1]
    if width3 % (3 * heads) or cos.shape != (t, rot) or sin.shape != cos.shape or rot % 2:
        raise ValueError(f"split_rope: qkv {tuple(qkv.shape)} with {heads} heads and cos/sin "
                         f"{tuple(cos.shape)}/{tuple(sin.shape)} do not fit")
    head_dim = width3 // (3 * heads)
    if rot > head_dim:
        raise ValueError(f"split_rope: rotary dim {rot} exceeds head dim {head_dim}")
    if not qkv.is_contiguous():
        raise ValueError("split_rope: qkv must be contiguous (it is rotated in place)")
    q, k, v = qkv.view(b, t, 3, heads, head_dim).unbind(2)
    if not uses_kernel(qkv):
        rotated_q, rotated_k, _ = split_rope_reference(qkv, cos, sin, heads)
        q.copy_(rotated_q)
        k.copy_(rotated_k)
    elif rot:
        _kernel()[(b * t,)](
            qkv, cos.float().contiguous(), sin.float().contiguous(), t,
            HEADS=heads, HEAD_DIM=head_dim, HALF=rot // 2, BLOCK_H=_pow2(heads), BLOCK_R=_pow2(rot // 2),
        )
    return q, k, v


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _kernel():
    """Build the Triton kernel on first use (imports Triton)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["tokens"])  # a divisor only: one binary for every window length
    def split_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, tokens,
                          HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
        token = tl.program_id(0)  # b * tokens + t
        t = token % tokens
        h = tl.arange(0, BLOCK_H)[:, None]
        j = tl.arange(0, BLOCK_R)[None, :]  # dim j of the first half, pairs with dim HALF + j
        mask = (h < HEADS) & (j < HALF)
        dtype = qkv_ptr.dtype.element_ty
        angle = t * 2 * HALF + j
        cos1 = tl.load(cos_ptr + angle, mask=j < HALF, other=1.0).to(dtype).to(tl.float32)  # [1, BLOCK_R]
        sin1 = tl.load(sin_ptr + angle, mask=j < HALF, other=0.0).to(dtype).to(tl.float32)
        cos2 = tl.load(cos_ptr + angle + HALF, mask=j < HALF, other=1.0).to(dtype).to(tl.float32)
        sin2 = tl.load(sin_ptr + angle + HALF, mask=j < HALF, other=0.0).to(dtype).to(tl.float32)
        for part in tl.static_range(2):  # q, then k
            base = qkv_ptr + token * 3 * HEADS * HEAD_DIM + part * HEADS * HEAD_DIM + h * HEAD_DIM + j
            first = tl.load(base, mask=mask, other=0.0).to(tl.float32)
            second = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
            # apply_rope in the dtype: head * cos + cat(-second, first) * sin, each op rounded. Each stored element
            # is computed from the loaded pair it overwrites, so the in-place update cannot race.
            new_first = (first * cos1).to(dtype).to(tl.float32) + ((-second) * sin1).to(dtype).to(tl.float32)
            new_second = (second * cos2).to(dtype).to(tl.float32) + (first * sin2).to(dtype).to(tl.float32)
            tl.store(base, new_first.to(dtype), mask=mask)
            tl.store(base + HALF, new_second.to(dtype), mask=mask)

    return split_rope_kernel
