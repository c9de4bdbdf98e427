"""The skinny decode GEMM's Triton kernel and its launch; kernels/skinny_linear.py describes it and holds the
public ops. Triton is imported on first use."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .fitting_stages import launch_fitting
from .pdl import launch_options, uses_pdl

__all__ = ["PREFETCH_BYTES", "ROW_TILE", "VARIANTS", "program_rows", "run_kernel"]

ROW_TILE = 16  # rows per program up to ROW_TILE rows; 2 * ROW_TILE beyond (K over warps: ROW_TILE always)

# The kernel's variants, a tile's optional fifth element (kernels/skinny_linear.py): name -> (widening, K over warps).
# Widening "cvt": Triton's cast, e4m3x2 -> f16x2 then f16 -> bf16 one element at a time, both on the GPU's conversion
# unit (16 results per clock per SM on sm_90; bench/skinny_asm.py shows it). "bits": four codes loaded as one int32,
# widened by shifts and masks into bf16 bit patterns worth 2**-120 of the value (subnormal codes a bf16 subnormal), no
# conversion instruction; the float32 accumulator is multiplied by 2**120 before the scale, which gives the bits of
# "cvt" (a power of two commutes with every rounding) while the float32 sums stay normal: a sum under 2**-6 in code
# units (x times codes) is a float32 subnormal there and rounds to steps of 2**-29 of the column's scale (the GPU
# sweep found the bits of "cvt" on random x with every finite code). "bits-mul": the same patterns multiplied by
# 2**120 per element before the dot (bf16x2, exact). A NaN code (quantize never writes one)
# reads +-480. K over warps ("-kwarps"): warp p of the program takes the p-th part of each K tile for all BLOCK_N
# columns (a batched dot), and the parts' float32 accumulators are summed once at the end: each warp reads only its
# part of x and runs one MMA chain per 8 columns, against all of x and one chain otherwise. Another order of sums:
# not the bits of "cvt", the same bound against the exact product. On bf16 weights "cvt" widens nothing.
VARIANTS = {
    "cvt": ("cvt", False), "bits": ("bits", False), "bits-mul": ("bits-mul", False), "cvt-kwarps": ("cvt", True),
    "bits-kwarps": ("bits", True),
}
WIDENINGS = {"cvt": 0, "bits": 1, "bits-mul": 2}  # the kernel's WORDS


def run_kernel(
    x: Tensor, w: Tensor, config: tuple[int, int, int, int] | tuple[int, int, int, int, str], gated: bool = False,
    residual: Tensor | None = None, scale: Tensor | None = None,
) -> Tensor:
    """The Triton kernel with an explicit (BLOCK_N, BLOCK_K, num_warps, num_stages[, variant]); bench/skinny_linear.py
    sweeps it. gated: w is [gate | up] and the result silu(gate) * up (BLOCK_N columns of each per program). scale:
    w's float32 scale per row when w is e4m3; variant: one of VARIANTS (default "cvt")."""
    k = x.shape[-1]
    n = w.shape[0] // 2 if gated else w.shape[0]
    rows = x.numel() // k
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages, *variant = config
    words, k_over_warps = _variant(w, scale, variant[0] if variant else "cvt")
    if k_over_warps and block_k % (16 * warps):
        raise ValueError(f"skinny_linear: K over {warps} warps needs BLOCK_K a multiple of {16 * warps}, got {block_k}")
    pdl = uses_pdl(x.device)
    x_rows, added = _rows(x, rows, k), (y if residual is None else _rows(residual, rows, n))
    line = 128 // w.element_size()  # weight elements in a 128-byte line
    block_m = program_rows(rows, k_over_warps)
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, RESIDUAL=residual is not None,
                     SCALED=scale is not None, WORDS=words, PARTS=warps if k_over_warps else 1, PDL=pdl,
                     PREFETCH_LINES=_prefetch_lines(block_n) if pdl else 1, LINE=line, num_warps=warps)
    launch = functools.partial(
        _kernel()[(math.ceil(rows / block_m), math.ceil(n / block_n))], x_rows, w, y, added,
        y if scale is None else scale, rows, n, k, w.stride(0), x_rows.stride(0), added.stride(0), **constants,
        **launch_options(pdl),
    )
    launch_fitting(launch, stages, (x.device, x.dtype, w.dtype, stages, *constants.values()))
    return y.view(*x.shape[:-1], n)


def program_rows(rows: int, k_over_warps: bool) -> int:
    """Rows per program (BLOCK_M, a compiled kernel of its own): ROW_TILE for up to ROW_TILE rows, else 2 * ROW_TILE.
    K over the warps sums its parts in an order that follows the tile's rows on the GPU: ROW_TILE always."""
    return ROW_TILE if rows <= ROW_TILE or k_over_warps else 2 * ROW_TILE


def _variant(w: Tensor, scale: Tensor | None, name: str) -> tuple[int, bool]:
    """(WORDS, K over warps) of a variant for this weight: rows that are not whole aligned int32 words take the "cvt"
    widening instead of a "bits" one, which gives the same bits."""
    if name not in VARIANTS:
        raise ValueError(f"skinny_linear: variant {name!r} is not one of {list(VARIANTS)}")
    widening, k_over_warps = VARIANTS[name]
    if widening != "cvt" and scale is None:
        raise ValueError("skinny_linear: the bits widenings are for e4m3 weights")
    whole_words = not (w.shape[1] % 4 or w.stride(0) % 4 or w.storage_offset() % 4)  # storage: 256-byte aligned
    return WIDENINGS[widening] if whole_words else 0, k_over_warps


def _rows(t: Tensor, rows: int, cols: int) -> Tensor:
    """t as [rows, cols] with unit stride along cols, copied only where no such view exists: a row slice of a longer
    sequence keeps its row stride, a row broadcast to every row its stride 0."""
    view = t.reshape(rows, cols)
    return view if view.stride(1) == 1 else view.contiguous()


# Under PDL each program pulls the start of its weight rows into L2 before waiting for x: this many bytes per
# program (per half when gated), in 128-byte lines along K. Measured on the H200 (2026-12-01),
# one-song talker step: 256 KB 8.44 ms, 128 KB 7.55, 64 KB 7.13, 32 KB 6.88, 16 KB 6.81, 8 KB 6.82, one line 6.85:
# a large prefetch holds the program's loads before its real work starts.
PREFETCH_BYTES = 16 * 1024


def _prefetch_lines(block_n: int) -> int:
    """Lines per weight row to prefetch (a power of two, at least 1)."""
    lines = PREFETCH_BYTES // (block_n * 128)
    return 1 << max(0, lines.bit_length() - 1)


@functools.cache
def _kernel():
    """Build the Triton kernel on first use (imports Triton)."""
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    unbias = tl.constexpr(2.0**120)  # bf16's exponent bias over e4m3's

    @triton.jit
    def _widen_words(words, MUL: tl.constexpr):
        # [..., BLOCK_K // 4] int32 words of four e4m3 codes (lowest byte first) -> [..., BLOCK_K] bf16, exact:
        # a code's sign to bf16's sign, its exponent and mantissa bits into bf16's low exponent and top mantissa bits
        # (worth value * 2**-120, subnormal codes a bf16 subnormal); MUL: then * 2**120 (bf16x2 multiplies on sm_90).
        w = words.to(tl.uint32, bitcast=True)
        odd = (w & 0x80008000) | ((w >> 4) & 0x07F007F0)  # codes 1 and 3 of each word
        even = ((w << 8) & 0x80008000) | ((w << 4) & 0x07F007F0)  # codes 0 and 2
        halves = tl.join(tl.join(even & 0xFFFF, even >> 16), tl.join(odd & 0xFFFF, odd >> 16))  # [..., 2 * hi + odd]
        bits = tl.reshape(halves, words.shape[:-1] + (4 * words.shape[-1],)).to(tl.uint16)
        if MUL:
            return (bits.to(tl.bfloat16, bitcast=True).to(tl.float32) * unbias).to(tl.bfloat16)
        return bits.to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _accumulate(x_ptr, w_ptr, m, cols, col_ok, rows, n, k, k0, stride_w, stride_x, acc, acc_up,
                    BLOCK_K: tl.constexpr, GATED: tl.constexpr, WORDS: tl.constexpr):
        # acc + x[m, k0 : k0 + BLOCK_K] @ w[cols, same].T, and GATED: acc_up + the same for w[n + cols]
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k
        if WORDS:
            k4 = k0 // 4 + tl.arange(0, BLOCK_K // 4)
            w_mask = col_ok[:, None] & (k4 < k // 4)[None, :]
            w_tile = w_ptr.to(tl.pointer_type(tl.int32)) + cols[:, None] * (stride_w // 4) + k4[None, :]
        else:
            w_mask = col_ok[:, None] & k_ok[None, :]
            w_tile = w_ptr + cols[:, None] * stride_w + kk[None, :]
        x = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :], mask=(m[:, None] < rows) & k_ok[None, :],
                    other=0.0)
        if WORDS:
            w = _widen_words(tl.load(w_tile, mask=w_mask, other=0, eviction_policy="evict_first"), WORDS == 2)
        else:
            w = tl.load(w_tile, mask=w_mask, other=0.0, eviction_policy="evict_first").to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            if WORDS:
                w_up = _widen_words(tl.load(w_tile + n * (stride_w // 4), mask=w_mask, other=0,
                                            eviction_policy="evict_first"), WORDS == 2)
            else:
                w_up = tl.load(w_tile + n * stride_w, mask=w_mask, other=0.0, eviction_policy="evict_first")
            acc_up = tl.dot(x, tl.trans(w_up.to(x.dtype)), acc_up)
        return acc, acc_up

    @triton.jit
    def _accumulate_parts(x_ptr, w_ptr, m, cols, col_ok, rows, n, k, k0, stride_w, stride_x, acc, acc_up,
                          BLOCK_K: tl.constexpr, PARTS: tl.constexpr, GATED: tl.constexpr, WORDS: tl.constexpr):
        # _accumulate with K tile [k0, k0 + BLOCK_K) in PARTS parts: acc[p] + x[:, part p] @ w[cols, part p].T, a
        # batched dot whose batch Triton spreads over the warps
        m = m[None, :, None]
        part = tl.arange(0, PARTS)[:, None] * (BLOCK_K // PARTS)
        kk = k0 + part + tl.arange(0, BLOCK_K // PARTS)[None, :]  # [PARTS, BLOCK_K // PARTS]
        k_ok = kk < k
        if WORDS:
            k4 = k0 // 4 + part // 4 + tl.arange(0, BLOCK_K // PARTS // 4)[None, :]
            w_mask = col_ok[None, :, None] & (k4 < k // 4)[:, None, :]
            w_tile = w_ptr.to(tl.pointer_type(tl.int32)) + cols[None, :, None] * (stride_w // 4) + k4[:, None, :]
        else:
            w_mask = col_ok[None, None, :] & k_ok[:, :, None]
            w_tile = w_ptr + cols[None, None, :] * stride_w + kk[:, :, None]  # [PARTS, BLOCK_K // PARTS, BLOCK_N]
        x = tl.load(x_ptr + m * stride_x + kk[:, None, :], mask=(m < rows) & k_ok[:, None, :], other=0.0)
        if WORDS:
            w = tl.permute(_widen_words(tl.load(w_tile, mask=w_mask, other=0, eviction_policy="evict_first"),
                                        WORDS == 2), (0, 2, 1))
        else:
            w = tl.load(w_tile, mask=w_mask, other=0.0, eviction_policy="evict_first").to(x.dtype)
        acc = tl.dot(x, w, acc)
        if GATED:
            up = w_tile + n * (stride_w // 4 if WORDS else stride_w)
            if WORDS:
                w_up = tl.permute(_widen_words(tl.load(up, mask=w_mask, other=0, eviction_policy="evict_first"),
                                               WORDS == 2), (0, 2, 1))
            else:
                w_up = tl.load(up, mask=w_mask, other=0.0, eviction_policy="evict_first").to(x.dtype)
            acc_up = tl.dot(x, w_up, acc_up)
        return acc, acc_up

    @triton.jit
    def _prefetch_l2(ptrs):
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    # `rows` only bounds masks: not specialised, one binary serves every row count (Triton would compile another for
    # a count divisible by 16, at every warm-up, and the rows beside a song would pick its binary).
    @triton.jit(do_not_specialize=["rows"])
    def skinny_linear_kernel(x_ptr, w_ptr, y_ptr, residual_ptr, scale_ptr, rows, n, k, stride_w, stride_x,
                             stride_residual, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GATED: tl.constexpr, RESIDUAL: tl.constexpr, SCALED: tl.constexpr, WORDS: tl.constexpr,
                             PARTS: tl.constexpr, PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                             LINE: tl.constexpr):
        # y[:, cols] = x @ w[cols].T; GATED: silu(x @ w[cols].T) * (x @ w[n + cols].T); RESIDUAL: residual + x @ w.T;
        # each intermediate rounded to y's dtype as the torch ops round it. SCALED: w holds e4m3 codes, widened to
        # x's dtype per tile, and each column's float32 accumulator is multiplied by its scale. WORDS (WIDENINGS):
        # those codes are loaded four per int32 and widened by _widen_words (k a multiple of 4). PARTS > 1: K over the
        # warps (VARIANTS).
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        if PDL:  # the weights are constant: start them towards L2 while the previous kernel finishes (kernels/pdl.py)
            lines = tl.arange(0, PREFETCH_LINES) * LINE
            line_ok = col_ok[:, None] & (lines[None, :] < k)
            heads = tl.where(line_ok, w_ptr + cols[:, None] * stride_w + lines[None, :], w_ptr)
            _prefetch_l2(heads)
            if GATED:
                _prefetch_l2(heads + n * stride_w)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PARTS > 1:
            parts = tl.zeros((PARTS, BLOCK_M, BLOCK_N), dtype=tl.float32)
            parts_up = tl.zeros((PARTS, BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, k, BLOCK_K):
                parts, parts_up = _accumulate_parts(x_ptr, w_ptr, m, cols, col_ok, rows, n, k, k0, stride_w,
                                                    stride_x, parts, parts_up, BLOCK_K, PARTS, GATED, WORDS)
            acc = tl.sum(parts, axis=0)
            acc_up = tl.sum(parts_up, axis=0)
        else:
            for k0 in range(0, k, BLOCK_K):
                acc, acc_up = _accumulate(x_ptr, w_ptr, m, cols, col_ok, rows, n, k, k0, stride_w, stride_x, acc,
                                          acc_up, BLOCK_K, GATED, WORDS)
        if WORDS == 1:  # the patterns' 2**-120, exactly
            acc = acc * unbias
            acc_up = acc_up * unbias
        if SCALED:
            acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
            if GATED:
                acc_up = acc_up * tl.load(scale_ptr + n + cols, mask=col_ok, other=0.0)[None, :]
        dtype = y_ptr.dtype.element_ty
        out = acc
        if GATED:
            gate = acc.to(dtype).to(tl.float32)
            act = (gate / (1.0 + libdevice.exp(-gate))).to(dtype).to(tl.float32)
            out = act * acc_up.to(dtype).to(tl.float32)
        y_mask = (m[:, None] < rows) & col_ok[None, :]
        if RESIDUAL:
            res = tl.load(residual_ptr + m[:, None] * stride_residual + cols[None, :], mask=y_mask, other=0.0)
            res = res.to(tl.float32)
            out = res + out.to(dtype).to(tl.float32)
        tl.store(y_ptr + m[:, None] * n + cols[None, :], out.to(dtype), mask=y_mask)

    return skinny_linear_kernel
