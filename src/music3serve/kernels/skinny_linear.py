"""y = x @ w.T for a few rows of bf16 x (decode steps: 2-128 rows), reading w once at close to copy bandwidth.

cuBLAS picks its kernel by the row count, so a row's result can change with the number of rows beside it, and
on the talker's shapes it reaches only 57-75% of copy bandwidth for the o / qkv / down projections
(docs/performance.md). Here one Triton program owns ``BLOCK_N`` output columns of one tile of rows (16 rows, the
smallest tensor-core tile, for up to 16 rows; 32 beyond; the last tile padded) and walks the whole K dimension in
``BLOCK_K`` steps, accumulating in float32, so:

- the arithmetic of a row does not depend on the other rows or on how many there are (batch invariance: the tile
  configuration is chosen from (N, K) only and every row tile runs the same program). A 16- and a 32-row tile give a
  row the same bits because Triton lowers both to the same warp-level MMA instruction (mma.sync m16n8k16 on Hopper:
  its warpgroup MMA needs 64-row tiles), each output summing its K steps in the same order. That is how Triton 3.x
  compiles them, not a promise of its API: tests/test_skinny_linear.py and bench/batch_invariance_probe.py check it
  bit for bit on the GPU. At 32 rows (eight songs' depth-decoder first call) 32-row tiles stream the weights at
  cuBLAS's speed where 16-row ones took up to 40% longer (H200: 13.7 us against 13.3 for cuBLAS and 18.4 for 16-row
  tiles on a 4096 x 4096 weight);
- w streams from memory about once per call: the grid is ``(row tiles, ceil(N / BLOCK_N))`` with the row tile
  varying fastest, so the programs reading the same columns run together and share them through L2; no split-K,
  no atomics, so results are deterministic.

``skinny_linear`` and ``skinny_gated_silu`` are custom ops (``music3serve::...``) so compiled hot paths
(models/fusion.py) call them as one opaque kernel each. They run the Triton kernel for bf16 CUDA inputs of at most
``MAX_ROWS`` rows (every row count of a frame step: 64 rows of 32 songs, the depth decoder's first call two positions
each) (x and a residual are read with their row stride, copied only without unit stride along K; w
needs unit stride along K) and the torch ops otherwise (prefill, float32, CPU), always returning a contiguous tensor
in x's dtype. The GPU tests bound the kernel against the exact float64 product (tests/test_skinny_linear.py).

FP8 weights (models/fp8.py): w in e4m3 with a float32 `scale` per output row. The same kernel loads the e4m3 tile
(half the bytes), widens it to bf16 in registers (exact), and multiplies the float32 accumulator by the column's
scale before the epilogue rounds it; off the kernel, `weight_only_reference`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.fp8 import Fp8Weight, weight_only_reference
from .decode_attention import triton_available
from .pdl import launch_options, uses_pdl

__all__ = [
    "MAX_ROWS", "ROW_TILE", "gated_silu_reference", "run_kernel", "skinny_gated_silu", "skinny_linear", "tile_config",
    "uses_kernel",
]

ROW_TILE = 16  # rows per program up to ROW_TILE rows; 2 * ROW_TILE beyond
MAX_ROWS = 128


# Fastest tiles of `python3 bench/skinny_linear.py --sweep` on the H200 (2026-11-30) for the
# talker's weights [N, K]: (BLOCK_N, BLOCK_K, num_warps, num_stages).
MEASURED_TILES = {
    (6144, 4096): (64, 256, 4, 4),  # backbone qkv
    (4096, 4096): (32, 512, 4, 4),  # backbone o, depth o and projection
    (24576, 4096): (64, 128, 4, 3),  # backbone gate_up
    (4096, 12288): (32, 512, 4, 4),  # backbone down
    (16385, 4096): (64, 256, 4, 3),  # legal-column head
    (12288, 4096): (32, 128, 4, 4),  # depth qkv and gate_up
    (4096, 6144): (32, 512, 4, 4),  # depth down
    (1024, 4096): (16, 512, 4, 3),  # depth heads
}


# The gated kernel's own sweep (2026-11-30), BLOCK_N per half, where it beats half the plain tile: the depth
# decoder's gate_up streams at 26.9 us with 32 columns per half against 31.6 us with 16 (rows 2).
MEASURED_GATED_TILES = {
    (12288, 4096): (32, 128, 4, 4),  # depth gate_up
}


# e4m3 weights, (n, k, gated) -> tile: the fastest of `python -m music3serve.bench.fp8 sweep` at 16 rows on the H200
# (2026-12-04). They reach only 40-55% of copy bandwidth (bf16: 71-88%): the widened tile is the dot's B operand,
# which goes back through shared memory (docs/performance.md). Without an entry: the bf16 tile with BLOCK_K doubled.
MEASURED_FP8_TILES: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (6144, 4096, False): (32, 512, 4, 4),  # backbone qkv: 14.6 us (0.40 of copy bandwidth)
    (4096, 4096, False): (32, 512, 4, 4),  # backbone o, depth o and projection: 9.9 us (0.39)
    (24576, 4096, True): (32, 256, 4, 3),  # backbone gate_up: 46.8 us (0.50)
    (4096, 12288, False): (32, 512, 4, 4),  # backbone down: 25.7 us (0.46)
    (16385, 4096, False): (64, 512, 4, 3),  # legal-column head: 28.7 us (0.55)
    (12288, 4096, False): (32, 512, 4, 4),  # depth qkv: 22.6 us (0.52)
    (12288, 4096, True): (32, 256, 4, 4),  # depth gate_up: 26.3 us (0.45)
    (4096, 6144, False): (32, 512, 4, 4),  # depth down: 13.8 us (0.43)
    (1024, 4096, False): (32, 512, 4, 4),  # depth heads: 9.2 us
}


def tile_config(n: int, k: int, gated: bool = False, fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [n, k] weight; a function of the shape only. gated: the
    weight is [gate | up] and BLOCK_N counts the columns of each (by default half the plain tile: the same bytes
    per program). fp8: the weight is e4m3."""
    if fp8:
        if (n, k, gated) in MEASURED_FP8_TILES:
            return MEASURED_FP8_TILES[(n, k, gated)]
        block_n, block_k, warps, stages = tile_config(n, k, gated)
        return block_n, 2 * block_k, warps, stages
    if gated and (n, k) in MEASURED_GATED_TILES:
        return MEASURED_GATED_TILES[(n, k)]
    block_n, block_k, warps, stages = MEASURED_TILES.get((n, k), (16 if n <= 1024 else 32, 128, 4, 4))
    return (max(16, block_n // 2) if gated else block_n), block_k, warps, stages


WEIGHT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)  # an e4m3 weight comes with its scale


def uses_kernel(x: Tensor, w: Tensor) -> bool:
    """Whether skinny_linear runs the Triton kernel for these inputs (else F.linear)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        x.is_cuda and x.dtype == torch.bfloat16 and w.dtype in WEIGHT_DTYPES and 0 < rows <= MAX_ROWS
        and w.dim() == 2 and w.stride(-1) == 1 and x.shape[-1] == w.shape[1] and triton_available()
    )


def _check_scale(w: Tensor, scale: Tensor | None) -> None:
    if (scale is None) == (w.dtype == torch.float8_e4m3fn) or (
            scale is not None and (scale.shape != w.shape[:1] or scale.dtype != torch.float32)):
        raise ValueError(f"skinny_linear: a {w.dtype} weight {tuple(w.shape)} takes "
                         + ("a float32 scale per output row" if w.dtype == torch.float8_e4m3fn else "no scale")
                         + f", got {None if scale is None else (tuple(scale.shape), scale.dtype)}")


def _product(x: Tensor, w: Tensor, scale: Tensor | None) -> Tensor:
    """x @ w.T by the torch ops: F.linear, or the FP8 weight's reference product."""
    return F.linear(x, w) if scale is None else weight_only_reference(x, Fp8Weight(w, scale))


def gated_silu_reference(x: Tensor, gate_up: Tensor, scale: Tensor | None = None) -> Tensor:
    """The torch ops of SwiGLU's first half: silu(gate) * up of x @ gate_up.T = [gate | up]."""
    gate, up = _product(x, gate_up, scale).chunk(2, dim=-1)
    return F.silu(gate) * up


def _check_residual(x: Tensor, w: Tensor, residual: Tensor | None) -> None:
    out_shape = (*x.shape[:-1], w.shape[0])
    if residual is not None and (residual.shape != out_shape or residual.dtype != x.dtype):
        raise ValueError(f"skinny_linear: residual {tuple(residual.shape)} {residual.dtype} must be the output's "
                         f"{out_shape} {x.dtype}")


@torch.library.custom_op("music3serve::skinny_linear", mutates_args=())
def skinny_linear(x: Tensor, w: Tensor, residual: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """x [..., K] @ w [N, K].T -> [..., N], plus `residual` [..., N] if given (added to the rounded product, as
    `residual + F.linear(x, w)` does; it may be one row broadcast to all rows); the Triton kernel for few bf16 CUDA
    rows, the torch ops otherwise. An e4m3 w comes with its float32 `scale` [N] (models/fp8.py)."""
    _check_residual(x, w, residual)
    _check_scale(w, scale)
    config = tile_config(*w.shape, fp8=scale is not None)
    if not uses_kernel(x, w):
        return (_product(x, w, scale) if residual is None else residual + _product(x, w, scale)).contiguous()
    return run_kernel(x, w, config, residual=residual, scale=scale)


@torch.library.custom_op("music3serve::skinny_gated_silu", mutates_args=())
def skinny_gated_silu(x: Tensor, gate_up: Tensor, scale: Tensor | None = None) -> Tensor:
    """silu(gate) * up of x @ gate_up.T = [gate | up], [..., N / 2]: one kernel reading gate_up once, rounding as
    the torch ops do (gate and up to x's dtype, then silu, then the product); gated_silu_reference otherwise. An
    e4m3 gate_up comes with its float32 `scale` [N]."""
    _check_scale(gate_up, scale)
    config = tile_config(*gate_up.shape, gated=True, fp8=scale is not None)
    if not uses_kernel(x, gate_up) or gate_up.shape[0] % 2:
        return gated_silu_reference(x, gate_up, scale).contiguous()
    return run_kernel(x, gate_up, config, gated=True, scale=scale)


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
    _kernel()[(math.ceil(rows / block_m), math.ceil(n / block_n))](
        x_rows, w, y, added, y if scale is None else scale, rows, n, k, w.stride(0), x_rows.stride(0),
        added.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated,
        RESIDUAL=residual is not None, SCALED=scale is not None, PDL=pdl,
        PREFETCH_LINES=_prefetch_lines(block_n) if pdl else 1, LINE=line, num_warps=warps, num_stages=stages,
        **launch_options(pdl),
    )
    return y.view(*x.shape[:-1], n)


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


@skinny_linear.register_fake
def _(x: Tensor, w: Tensor, residual: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    _check_residual(x, w, residual)
    return x.new_empty(*x.shape[:-1], w.shape[0])


@skinny_gated_silu.register_fake
def _(x: Tensor, gate_up: Tensor, scale: Tensor | None = None) -> Tensor:
    return x.new_empty(*x.shape[:-1], gate_up.shape[0] // 2)


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

    @triton.jit
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
