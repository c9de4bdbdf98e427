"""The skinny decode GEMM's Triton kernel and its launch; kernels/skinny_linear.py describes it and holds the
public ops. Triton is imported on first use."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .pdl import launch_options, uses_pdl

__all__ = ["PREFETCH_BYTES", "ROW_TILE", "run_kernel"]

ROW_TILE = 16  # rows per program up to ROW_TILE rows; 2 * ROW_TILE beyond


def run_kernel(
    x: Tensor, w: Tensor, config: tuple[int, int, int, int], gated: bool = False, residual: Tensor | None = None,
    scale: Tensor | None = None,
) -> Tensor:
    """The Triton kernel with an explicit (BLOCK_N, BLOCK_K, num_warps, num_stages); bench/skinny_linear.py sweeps it.
    gated: w is [gate | up] and the result silu(gate) * up (BLOCK_N columns of each per program). scale: w's float32
    scale per row when w is e4m3."""
    k = x.shape[-1]
    n = w.shape[0] // 2 if gated else w.shape[0]
    rows = x.numel() // k
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config
    pdl = uses_pdl(x.device)
    x_rows, added = _rows(x, rows, k), (y if residual is None else _rows(residual, rows, n))
    line = 128 // w.element_size()  # weight elements in a 128-byte line
    block_m = ROW_TILE if rows <= ROW_TILE else 2 * ROW_TILE
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, RESIDUAL=residual is not None,
                     SCALED=scale is not None, PDL=pdl, PREFETCH_LINES=_prefetch_lines(block_n) if pdl else 1,
                     LINE=line, num_warps=warps)
    launch = functools.partial(
        _kernel()[(math.ceil(rows / block_m), math.ceil(n / block_n))], x_rows, w, y, added,
        y if scale is None else scale, rows, n, k, w.stride(0), x_rows.stride(0), added.stride(0), **constants,
        **launch_options(pdl),
    )
    _launch_fitting(launch, stages, (x.device, x.dtype, w.dtype, stages, *constants.values()))
    return y.view(*x.shape[:-1], n)


# A tile's num_stages where it does not fit the GPU's shared memory, by launch: at 2 * ROW_TILE rows a stage holds
# twice the x tile, and Triton widens e4m3 weights through shared memory, so a tile measured at ROW_TILE rows may need
# fewer. Fewer stages only shorten how far the loads run ahead of the arithmetic: a row's bits stay the tile's.
_STAGES_THAT_FIT: dict[tuple, int] = {}


def _launch_fitting(launch, stages: int, key: tuple) -> None:
    """launch(num_stages=...) with `stages`, or the most below it that fit (remembered under `key`)."""
    from triton.runtime.errors import OutOfResources

    stages = _STAGES_THAT_FIT.get(key, stages)
    while True:
        try:
            launch(num_stages=stages)
        except OutOfResources:  # raised when the compiled kernel is loaded, before it runs
            if stages == 1:
                raise
            stages -= 1
            continue
        _STAGES_THAT_FIT[key] = stages
        return


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

    @triton.jit
    def _prefetch_l2(ptrs):
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    # `rows` only bounds masks: not specialised, one binary serves every row count (Triton would compile another for
    # a count divisible by 16, at every warm-up, and the rows beside a song would pick its binary).
    @triton.jit(do_not_specialize=["rows"])
    def skinny_linear_kernel(x_ptr, w_ptr, y_ptr, residual_ptr, scale_ptr, rows, n, k, stride_w, stride_x,
                             stride_residual, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GATED: tl.constexpr, RESIDUAL: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr,
                             PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr):
        # y[:, cols] = x @ w[cols].T; GATED: silu(x @ w[cols].T) * (x @ w[n + cols].T); RESIDUAL: residual + x @ w.T;
        # each intermediate rounded to y's dtype as the torch ops round it. SCALED: w holds e4m3 codes, widened to
        # x's dtype per tile, and each column's float32 accumulator is multiplied by its scale.
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
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < k
            w_mask = col_ok[:, None] & k_ok[None, :]
            w_tile = w_ptr + cols[:, None] * stride_w + kk[None, :]
            x = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :], mask=(m[:, None] < rows) & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_tile, mask=w_mask, other=0.0, eviction_policy="evict_first").to(x.dtype)
            acc = tl.dot(x, tl.trans(w), acc)
            if GATED:
                w_up = tl.load(w_tile + n * stride_w, mask=w_mask, other=0.0, eviction_policy="evict_first")
                acc_up = tl.dot(x, tl.trans(w_up.to(x.dtype)), acc_up)
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
