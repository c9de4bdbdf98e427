"""The k-th largest value of each row of float32 logits: the top-k sampler's threshold, in one small kernel.

`torch.topk` on the talker's rows (1-16 rows of 1024 or 16385 columns) launches a multi-pass radix select of
~25-70 us each, nine times per frame step. For the seven depth-decoder draws (1024 columns) one Triton program per
row loads the whole row (padded with -inf to a power of two, which cannot change the k-th largest of the real
columns), keeps its top ``next_power_of_2(k)`` with Triton's bitonic top-k and returns element k - 1: the same
value `torch.topk` gives (duplicates counted, as a multiset).

Wider rows (the two semantic draws, 16385 columns) take two passes: one program per ``CHUNK`` columns keeps that
chunk's top ``next_power_of_2(k)``, then the one-pass kernel takes the k-th largest of those candidates. The same
value: each of the row's k largest (as a multiset) is among the k largest of its own chunk, so the candidates
hold the row's k largest, and nothing larger. A custom op (``music3serve::kth_largest``), so compiled hot paths
call it whole; CPU tensors, other dtypes, and rows whose candidates would not fit one program take `torch.topk`.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .decode_attention import triton_available

__all__ = ["MAX_COLUMNS", "kth_largest", "kth_largest_reference", "uses_kernel"]

# One row per program, held in registers. One pass over a whole 16385-column semantic row (padded to 32768)
# took ~0.2 ms a call on the H200 (2026-11-30); such rows take two passes of CHUNK columns per program instead.
MAX_COLUMNS = 4096
CHUNK = 2048


def kth_largest_reference(x: Tensor, k: int) -> Tensor:
    """[rows, 1]: the k-th largest value of each row of x [rows, columns] (unsorted top-k, its minimum)."""
    return torch.topk(x, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)


def _check(x: Tensor, k: int) -> None:
    if x.dim() != 2 or not 1 <= k <= x.shape[-1]:
        raise ValueError(f"kth_largest needs x [rows, columns] and 1 <= k <= columns, got {tuple(x.shape)} and k={k}")


@functools.cache
def triton_has_topk() -> bool:
    """Whether Triton is importable and has `tl.topk` (added in the 3.4 line)."""
    if not triton_available():
        return False
    import triton.language as tl

    return hasattr(tl, "topk")


@torch.library.custom_op("music3serve::kth_largest", mutates_args=())
def kth_largest(x: Tensor, k: int, num_warps: int = 4) -> Tensor:
    """[rows, 1]: the k-th largest value of each row of x [rows, columns]; the Triton kernel for float32 CUDA rows
    of at most MAX_COLUMNS columns, kth_largest_reference otherwise. num_warps: bench/top_k.py sweeps it."""
    _check(x, k)
    if not uses_kernel(x, k):
        return kth_largest_reference(x, k).contiguous()
    rows, columns = x.shape
    keep = _keep(k)
    candidates = _candidates(columns, keep)
    one_pass, chunk_top = _kernels()
    x = x.contiguous()
    if columns > MAX_COLUMNS:  # pass 1: each chunk's top `keep`, side by side (the last chunk padded with -inf)
        tops = torch.empty(rows, candidates, dtype=x.dtype, device=x.device)
        chunk_top[(rows, candidates // keep)](x, tops, columns, BLOCK=CHUNK, KEEP=keep, num_warps=num_warps)
        x, columns = tops, candidates
    out = torch.empty(rows, 1, dtype=x.dtype, device=x.device)
    one_pass[(rows,)](x, out, columns, k, BLOCK=max(keep, _pow2(columns)), KEEP=keep, num_warps=num_warps)
    return out


def uses_kernel(x: Tensor, k: int) -> bool:
    """Whether kth_largest runs the Triton kernels for x [rows, columns] (else torch.topk): float32 CUDA rows whose
    candidates fit one program."""
    return (x.is_cuda and x.dtype == torch.float32 and _candidates(x.shape[-1], _keep(k)) <= MAX_COLUMNS
            and triton_has_topk())


def _candidates(columns: int, keep: int) -> int:
    """Values the last pass ranks: the whole row, or each CHUNK's top `keep` side by side."""
    return -(-columns // CHUNK) * keep if columns > MAX_COLUMNS else columns


def _pow2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << (n - 1).bit_length()


def _keep(k: int) -> int:
    """How many of the largest a program keeps for the k-th: a power of two >= k, at least 2 (a one-element
    top-k reduces to a scalar)."""
    return max(2, _pow2(k))


@kth_largest.register_fake
def _(x: Tensor, k: int, num_warps: int = 4) -> Tensor:
    _check(x, k)
    return x.new_empty(x.shape[0], 1)


@functools.cache
def _kernels():
    """(one_pass, chunk_top), built on first use (imports Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kth_largest_kernel(x_ptr, out_ptr, columns, k, BLOCK: tl.constexpr, KEEP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * columns + offs, mask=offs < columns, other=float("-inf"))
        top = tl.topk(x, KEEP)  # the KEEP largest, descending
        kth = tl.sum(tl.where(tl.arange(0, KEEP) == k - 1, top, 0.0), axis=0)
        tl.store(out_ptr + row, kth)

    @triton.jit
    def chunk_top_kernel(x_ptr, tops_ptr, columns, BLOCK: tl.constexpr, KEEP: tl.constexpr):
        row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * columns + offs, mask=offs < columns, other=float("-inf"))
        chunks = tl.num_programs(1)
        tl.store(tops_ptr + (row * chunks + chunk) * KEEP + tl.arange(0, KEEP), tl.topk(x, KEEP))

    return kth_largest_kernel, chunk_top_kernel
