"""The k-th largest value of each row of float32 logits: the top-k sampler's threshold, in one small kernel.

`torch.topk` on the talker's rows (1-16 rows of 1024 or 16385 columns) launches a multi-pass radix select of
~25 us each, nine times per frame step. For the seven depth-decoder draws (1024 columns) one Triton program per
row loads the whole row (padded with -inf to a power of two, which cannot change the k-th largest of the real
columns), keeps its top ``next_power_of_2(k)`` with Triton's bitonic top-k and returns element k - 1: the same
value `torch.topk` gives (duplicates counted, as a multiset). A custom op (``music3serve::kth_largest``), so
compiled hot paths call it whole; CPU tensors, other dtypes and rows wider than ``MAX_COLUMNS`` take `torch.topk`.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .decode_attention import triton_available

__all__ = ["MAX_COLUMNS", "kth_largest", "kth_largest_reference"]

# One row per program, held in registers. Wider rows take torch.topk: on the H200 the bitonic top-k of the
# 16385-column semantic rows (padded to 32768) took ~0.2 ms a call against torch.topk's ~25 us (session 4).
MAX_COLUMNS = 4096


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
    columns = x.shape[-1]
    if not (x.is_cuda and x.dtype == torch.float32 and columns <= MAX_COLUMNS and triton_has_topk()):
        return kth_largest_reference(x, k).contiguous()
    x = x.contiguous()
    out = torch.empty(x.shape[0], 1, dtype=x.dtype, device=x.device)
    keep = max(2, 1 << (k - 1).bit_length())  # at least 2: a one-element top-k reduces to a scalar
    block = max(keep, 1 << (columns - 1).bit_length())
    _kernel()[(x.shape[0],)](x, out, columns, k, BLOCK=block, KEEP=keep, num_warps=num_warps)
    return out


@kth_largest.register_fake
def _(x: Tensor, k: int, num_warps: int = 4) -> Tensor:
    _check(x, k)
    return x.new_empty(x.shape[0], 1)


@functools.cache
def _kernel():
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

    return kth_largest_kernel
