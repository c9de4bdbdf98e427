"""The DiT's bidirectional attention, reading q, k, v where split_rope left them and writing the o projection's input.

``q``, ``k``, ``v`` are [batch, tokens, heads, head_dim] strided views (of the fused QKV buffer); the result is
[batch, tokens, heads * head_dim], contiguous, the layout the o projection reads, so no transpose copy follows.

On CUDA with Triton, for bf16/fp16 operands and a power-of-two head_dim up to 128 (the bf16 policy's DiT), one
flash-attention kernel: grid (query blocks, batch * heads); each program holds BLOCK_M queries of one head and
runs an fp32 online softmax (exp2 domain) over the keys in blocks of BLOCK_N, the last block masked. A program's
work does not depend on the batch, so a window's attention is bit for bit the same alone or batched with others.
Elsewhere (CPU, the float32 reference policy, other head dims) it is torch's scaled_dot_product_attention, as the
reference computes it.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .decode_attention import triton_available

__all__ = ["Config", "dit_attention", "dit_attention_reference", "uses_kernel"]

Config = tuple[int, int, int, int]  # BLOCK_M, BLOCK_N, num_warps, num_stages
# The fastest of 23 tiles at eight windows, within 2% of the fastest at one (two sweeps of bench/dit_attention.py,
# measured 2026-12-01).
DEFAULT_CONFIG: Config = (64, 64, 4, 3)


def dit_attention_reference(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """torch's SDPA over [batch, heads, tokens, head_dim], back to [batch, tokens, heads * head_dim]."""
    b, t, h, d = q.shape
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).reshape(b, t, h * d)


def uses_kernel(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether dit_attention runs the Triton kernel for these operands: bf16/fp16 on one CUDA device, one dtype,
    head_dim a power of two in 16..128 with a unit stride, at least one token, at most 65535 (batch, head) pairs, and
    each batch entry's offsets within int32 (the kernel's index arithmetic)."""
    b, t, h, d = q.shape
    return (
        q.is_cuda and triton_available() and k.device == v.device == q.device
        and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
        and 16 <= d <= 128 and d & (d - 1) == 0 and all(x.stride(-1) == 1 for x in (q, k, v))
        and t > 0 and b * h <= 65535 and all(t * x.stride(1) + h * x.stride(2) < 2**31 for x in (q, k, v))
    )


def dit_attention(q: Tensor, k: Tensor, v: Tensor, config: Config | None = None) -> Tensor:
    """softmax(q k^T / sqrt(head_dim)) v per head; q, k, v [batch, tokens, heads, head_dim]. Returns [batch, tokens,
    heads * head_dim]. ``config`` overrides the kernel's tiles (benchmarks)."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"dit_attention: q, k, v must be [batch, tokens, heads, head_dim] of one shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not uses_kernel(q, k, v):
        return dit_attention_reference(q, k, v)
    b, t, h, d = q.shape
    out = torch.empty(b, t, h, d, device=q.device, dtype=q.dtype)
    block_m, block_n, warps, stages = config or DEFAULT_CONFIG
    _kernel()[((t + block_m - 1) // block_m, b * h)](
        q, k, v, out, t, math.log2(math.e) / math.sqrt(d),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        HEADS=h, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )
    return out.view(b, t, h * d)


@functools.cache
def _kernel():
    """Build the Triton kernel on first use (imports Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def online_softmax_step(s, vv, m_i, l_i, acc):
        # Fold one key block (scores s in the log2 domain, values vv) into the running max, sum and output.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)

    @triton.jit(do_not_specialize=["tokens"])  # it bounds masks and loops only: one binary for every window length
    def dit_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tokens, qk_scale,
                             sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
                             HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        bh = tl.program_id(1)
        b = (bh // HEADS).to(tl.int64)
        h = bh % HEADS
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)
        q = tl.load(q_ptr + b * sq_b + h * sq_h + m[:, None] * sq_t + d[None, :], mask=m[:, None] < tokens, other=0.0)
        k_base = k_ptr + b * sk_b + h * sk_h + d[:, None] + n[None, :] * sk_t  # [HEAD_DIM, BLOCK_N]: k transposed
        v_base = v_ptr + b * sv_b + h * sv_h + n[:, None] * sv_t + d[None, :]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        full = tokens // BLOCK_N * BLOCK_N
        for start in range(0, full, BLOCK_N):  # whole key blocks, unmasked
            s = tl.dot(q, tl.load(k_base + start * sk_t)) * qk_scale
            m_i, l_i, acc = online_softmax_step(s, tl.load(v_base + start * sv_t), m_i, l_i, acc)
        if full < tokens:  # the last, partial block
            valid = full + n < tokens
            s = tl.dot(q, tl.load(k_base + full * sk_t, mask=valid[None, :], other=0.0)) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            vv = tl.load(v_base + full * sv_t, mask=valid[:, None], other=0.0)
            m_i, l_i, acc = online_softmax_step(s, vv, m_i, l_i, acc)
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * so_b + h * so_h + m[:, None] * so_t + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=m[:, None] < tokens)

    return dit_attention_kernel
