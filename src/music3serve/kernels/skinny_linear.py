"""y = x @ w.T for a few rows of bf16 x (decode steps: 2-128 rows), reading w once at close to copy bandwidth.

cuBLAS picks its kernel by the row count, so a row's result can change with the number of rows beside it, and
on the talker's shapes it reaches only 57-75% of copy bandwidth for the o / qkv / down projections
(docs/performance.md). Here one Triton program owns ``BLOCK_N`` output columns of one tile of rows (16 rows, the
smallest tensor-core tile, for up to 16 rows; 32 beyond, except FP8 tiles that split K over the warps, which stay
at 16; the last tile padded) and walks the whole K dimension in ``BLOCK_K`` steps, accumulating in float32, so:

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
``MAX_ROWS`` rows and the torch ops otherwise (prefill, float32, CPU), always returning a contiguous tensor in x's
dtype. 128 rows hold every frame step of up to 32 songs (64 rows; the depth decoder's first call, two positions a row,
128): past that cuBLAS takes the calls, and a song's rounding follows the batch again. x and a residual are read with
their row stride (copied only without unit stride along K); w needs unit stride along K. The GPU tests bound the
kernel against the exact float64 product (tests/test_skinny_linear.py).

FP8 weights (models/fp8.py): w in e4m3 with a float32 `scale` per output row. The same kernel loads the e4m3 tile
(half the bytes), widens it to bf16 in registers (exact; skinny_linear_kernel.VARIANTS says how), and multiplies
the float32 accumulator by the column's scale before the epilogue rounds it; off the kernel, `weight_only_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.fp8 import Fp8Weight, weight_only_reference
from .decode_attention import triton_available
from .skinny_linear_kernel import run_kernel

__all__ = [
    "MAX_ROWS", "gated_silu_reference", "run_kernel", "skinny_gated_silu", "skinny_linear", "tile_config",
    "uses_kernel",
]

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
# (2026-12-06), (us, weight bytes over copy bandwidth). A fifth element picks the kernel's variant
# (skinny_linear_kernel.VARIANTS): "bits" widens without conversion instructions, 15-24% faster than Triton's cast
# ("cvt", which spends 1.5 of them per element: bench/skinny_asm.py); "-kwarps" splits K over the warps, a further
# 1-31% on the weights with few columns per K. Depth gate_up's "bits-mul" (21.55 us) is within 2% of "bits".
# Without an entry: the bf16 tile, BLOCK_K doubled.
MEASURED_FP8_TILES: dict[tuple[int, int, bool], tuple[int, ...]] = {
    (6144, 4096, False): (64, 512, 4, 3, "bits"),  # backbone qkv: 11.65 us (0.50)
    (4096, 4096, False): (32, 1024, 4, 4, "bits-kwarps"),  # backbone o, depth o and projection: 8.62 us (0.45)
    (24576, 4096, True): (128, 256, 8, 4, "bits"),  # backbone gate_up: 36.41 us (0.64)
    (4096, 12288, False): (32, 1024, 4, 4, "bits-kwarps"),  # backbone down: 18.33 us (0.64)
    (16385, 4096, False): (128, 256, 8, 4, "bits"),  # legal-column head: 21.5 us (0.72)
    (12288, 4096, False): (64, 512, 4, 3, "bits"),  # depth qkv: 18.86 us (0.62)
    (12288, 4096, True): (64, 256, 4, 6, "bits"),  # depth gate_up: 21.95 us (0.53)
    (4096, 6144, False): (32, 1024, 4, 4, "bits-kwarps"),  # depth down: 11.02 us (0.53)
    (1024, 4096, False): (16, 1024, 4, 4, "bits-kwarps"),  # depth heads: 5.5 us (0.18)
}


def tile_config(n: int, k: int, gated: bool = False, fp8: bool = False) -> tuple[int, ...]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [n, k] weight; a function of the shape only. gated: the
    weight is [gate | up] and BLOCK_N counts the columns of each (by default half the plain tile: the same bytes
    per program). fp8: the weight is e4m3, and a fifth element may name a kernel variant (VARIANTS)."""
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


@skinny_linear.register_fake
def _(x: Tensor, w: Tensor, residual: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    _check_residual(x, w, residual)
    return x.new_empty(*x.shape[:-1], w.shape[0])


@skinny_gated_silu.register_fake
def _(x: Tensor, gate_up: Tensor, scale: Tensor | None = None) -> Tensor:
    return x.new_empty(*x.shape[:-1], gate_up.shape[0] // 2)
