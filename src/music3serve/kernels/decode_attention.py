"""Decode attention over a slotted KV cache that reads only each slot's filled rows.

One new query token per row attends to positions ``[0, lengths[r])`` of that row's KV slot. The cache is the
per-layer view ``cache[layer]`` of a ``[layers, rows, kv_heads, capacity, head_dim]`` tensor, so the row dim has
a stride and the last two dims are contiguous. Lengths live on the device and are read there, so one CUDA graph
captured for a batch shape replays correctly as the lengths grow.

On CUDA with Triton importable the work runs as flash-decoding, in two kernels:

1. ``split``: grid ``(programs, kv_heads, rows)``. A row's filled length L is cut into at most ``num_splits`` shares
   of ``max(split_blocks, ceil(blocks(L) / num_splits))`` blocks of ``BLOCK_N`` positions (computed on the device
   from ``lengths[r]``). The programs of one KV head of one row take its shares in turn (program p: shares p,
   p + programs, ...), each with all query heads of that head's GQA group together, so each K/V block is loaded once
   for the whole group. Per share a program runs an online softmax in fp32 (exp2 domain) and writes the share's
   normalised partial output and its log-sum-exp. The cost follows the filled length, not the capacity; positions at
   or beyond ``lengths[r]`` are never loaded (masked loads), so whatever sits there (stale rows, NaN) cannot leak
   into the result.
2. ``combine``: grid ``(q_heads, rows)``. Merges the shares of one head by their log-sum-exps.

A row's shares, hence the order its positions are summed and merged in, follow its filled length alone; which program
computes a share changes nothing in it. So ``programs`` can follow the row count (about one program per SM, at most
``num_splits``: many for a few rows, few for many) while a row's result does not depend on the other rows or on how
many there are (batch invariance). ``num_splits`` follows the capacity (``_choose_num_splits``) and ``programs`` the
row count, so a launch grid is static for a captured batch shape.

``append=(k_new, v_new, positions)`` also stores each row's new key and value at ``positions[r]`` of its slot
(what a decode step must do before attending). The Triton path does it inside ``split``, with no launch of its
own: the row's first program stores them (where the position lies within the capacity), and every program uses them
in place of what its tile loaded from that position.

``rotation=(q_norm, k_norm, eps, cos, sin)`` (Triton path only): q and the appended key arrive as projections, and
``split`` turns them into attention inputs as it loads them, rounding as the torch ops of a Qwen3 layer do: each head
RMS-normed (float32 statistics, the product rounded to the cache dtype, then the norm weight applied and rounded), then
rotated (half-split RoPE: cos and sin [rows, head_dim] float32 rounded to the cache dtype, each product and the sum
rounded). With a bf16 cache that gives the torch ops' bits; with a float32 one the float32 sum of squares may add in
another order (ulps apart). The split kernel compiles without floating-point contraction: with it, LLVM fused a
rounded product and the sum into one bf16 fused multiply-add, one rounding fewer than the torch ops (15% of the
stored keys' elements one bf16 step off on the H200). That holds for every launch of it, the depth decoder's too:
the kernel rounds one way whatever it is asked. One kernel fewer per layer than normalizing and rotating
beforehand. The stored key is the rotated one.

Elsewhere (CPU, or no Triton) ``decode_attention`` runs ``decode_attention_reference``: plain torch, masked over
the capacity, fp32 softmax. It is the test oracle too. Rows with length 0 give zeros on both paths.

Triton is imported lazily: this module imports fine where Triton is absent.
"""

import functools
import math

import torch
from torch import Tensor

from .decode_attention_kernels import triton_kernels
from .decode_attention_reference import (
    Append,
    Rotation,
    check_append,
    check_rotation,
    check_shapes,
    decode_attention_reference,
)
from .pdl import launch_options, uses_pdl

__all__ = ["Rotation", "decode_attention", "decode_attention_reference", "takes_rotation", "triton_available"]

_LOG2E = 1.4426950408889634


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported here (checked once)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float | None = None,
    append: Append | None = None, rotation: Rotation | None = None,
) -> Tensor:
    """Attention of one new token per row over the filled positions of its KV slot.

    q: [rows, q_heads, head_dim]; k_cache, v_cache: [rows, kv_heads, capacity, head_dim] (last dim contiguous);
    lengths: int32/int64 [rows] on q's device, valid positions per row (the new token's K/V at ``lengths[r] - 1``:
    already written, or written by ``append``). Returns [rows, q_heads, head_dim] in q's dtype: softmax(q k^T *
    scale) v over positions ``[0, lengths[r])``; ``scale`` defaults to ``head_dim ** -0.5``.
    ``append=(k_new, v_new, positions)`` first stores row r's new key and value [rows, kv_heads, head_dim] at
    ``positions[r]`` of its slot (int [rows], each in ``[0, capacity)``: the Triton path stores nothing for a
    position outside that range).

    ``rotation`` (with ``append``): q and k_new are projections to norm and rotate first (module docstring); Triton
    path only, see ``takes_rotation``.

    CUDA tensors with Triton importable run the Triton flash-decoding kernels (graph capturable: lengths are read
    on the device); anything else runs ``decode_attention_reference``."""
    if takes_rotation(q.device):
        return _decode_attention_triton(q, k_cache, v_cache, lengths, scale, append=append, rotation=rotation)
    if rotation is not None:  # checked first, so that a caller learns every problem on the CPU too
        check_shapes(q, k_cache, v_cache, lengths)
        if append is not None:
            check_append(append, k_cache)
        check_rotation(rotation, q, k_cache, append)
        raise ValueError("decode_attention: rotation needs the Triton path (CUDA tensors, Triton importable)")
    return decode_attention_reference(q, k_cache, v_cache, lengths, scale, append)


def takes_rotation(device: torch.device) -> bool:
    """Whether decode_attention on this device can norm and rotate q and the new key itself (``rotation``)."""
    return device.type == "cuda" and triton_available()


# --------------------------------------------------------------------------------------------------------------
# Triton path


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Defaults for Hopper (H100/H200), head_dim 128, bf16: K and V blocks of 64 positions, 4 warps, a 3-stage
# pipeline (bench/decode_attention.py --sweep on an H200: 36 layers, capacity 10240, rows 2 and 16, filled 1k/5k/10k;
# 2 stages cost up to 35% more). A row's filled length is cut into at most 8 shares of at least 4 blocks (256
# positions), whatever the rows beside it; about one program per SM at full length takes them (2 rows: 8 programs
# per KV head; 16 rows: 2, each running 4 shares in turn).
_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 3
_MAX_SPLITS = 8
_SPLIT_BLOCKS = 4
_PROGRAMS_PER_SM = 1


def _choose_num_splits(capacity: int, block_n: int, split_blocks: int = _SPLIT_BLOCKS) -> int:
    """Shares per (row, kv_head) at most: _MAX_SPLITS, fewer when the capacity holds fewer shares of split_blocks
    blocks. A function of the capacity alone: each row's share is then max(split_blocks, ceil(blocks(L) / _MAX_SPLITS))
    blocks of its filled length L, whatever the other rows (and whatever the capacity: a smaller one gives every
    length it can hold shares of split_blocks)."""
    return max(1, min(_MAX_SPLITS, math.ceil(capacity / (block_n * split_blocks))))


def _choose_programs(rows: int, kv_heads: int, num_splits: int, device: torch.device) -> int:
    """Programs per (row, kv_head): enough to fill the GPU when the rows are long, at most one per share. They change
    which program computes a share, never the share (batch invariance holds for any count)."""
    if device.type != "cuda":  # Triton's interpreter: one program per share
        return num_splits
    want = math.ceil(_PROGRAMS_PER_SM * _sm_count(device.index or 0) / max(1, rows * kv_heads))
    return max(1, min(want, num_splits))


def _decode_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    lengths: Tensor,
    scale: float | None = None,
    *,
    block_n: int = _BLOCK_N,
    num_warps: int = _NUM_WARPS,
    num_stages: int = _NUM_STAGES,
    num_splits: int | None = None,
    split_blocks: int = _SPLIT_BLOCKS,
    programs: int | None = None,
    append: Append | None = None,
    rotation: Rotation | None = None,
) -> Tensor:
    rows, q_heads, kv_heads, capacity, head_dim = check_shapes(q, k_cache, v_cache, lengths)
    if append is not None:
        check_append(append, k_cache)
    if rotation is not None:
        check_rotation(rotation, q, k_cache, append)
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the Triton decode attention needs a power-of-two head_dim >= 16, got {head_dim}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dim")
    if not (q.device == k_cache.device == v_cache.device == lengths.device):
        raise ValueError("q, k_cache, v_cache and lengths must be on one device")
    if scale is None:
        scale = head_dim**-0.5
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    out_dtype = q.dtype
    if q.dtype != k_cache.dtype:
        q = q.to(k_cache.dtype)  # tl.dot wants matching operand types; the output goes back to q's dtype below

    triton, split_kernel, combine_kernel = triton_kernels()
    group = q_heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    if num_splits is None:
        num_splits = _choose_num_splits(capacity, block_n, split_blocks)
    splits_pad = max(2, triton.next_power_of_2(num_splits))
    if programs is None:
        programs = _choose_programs(rows, kv_heads, num_splits, q.device)

    out = torch.empty((rows, q_heads, head_dim), device=q.device, dtype=out_dtype)
    if rows == 0:
        return out
    k_new, v_new, positions = append if append is not None else (q, q, lengths)  # placeholders when not appending
    if k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    pdl = uses_pdl(q.device)
    o_part = torch.empty((rows, q_heads, num_splits, head_dim), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((rows, q_heads, num_splits), device=q.device, dtype=torch.float32)
    q_norm, k_norm, eps, cos, sin = rotation if rotation is not None else (q, q, 0.0, lengths, lengths)

    split_kernel[(min(programs, num_splits), kv_heads, rows)](
        q, k_cache, v_cache, lengths, o_part, lse_part, out,
        k_new, v_new, positions, q_norm, k_norm, cos, sin,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos.stride(0),
        capacity, scale * _LOG2E, eps,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, SPLIT_BLOCKS=split_blocks,
        BLOCK_N=block_n, APPEND=append is not None, ROTATE=rotation is not None, PDL=pdl, num_warps=num_warps,
        num_stages=num_stages, enable_fp_fusion=False, **launch_options(pdl),
    )  # fmt: skip
    if num_splits == 1:  # the split kernel wrote the result
        return out
    combine_kernel[(q_heads, rows)](
        o_part, lse_part, lengths, out,
        out.stride(0), out.stride(1),
        capacity,
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, SPLITS_PAD=splits_pad, CHUNK=min(16, splits_pad),
        SPLIT_BLOCKS=split_blocks, BLOCK_N=block_n,
        PDL=pdl, num_warps=4, **launch_options(pdl),
    )  # fmt: skip
    return out
