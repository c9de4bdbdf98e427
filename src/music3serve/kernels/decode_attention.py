"""Decode attention over a slotted KV cache that reads only each slot's filled rows.

One new query token per row attends to positions ``[0, lengths[r])`` of that row's KV slot. The cache is the
per-layer view ``cache[layer]`` of a ``[layers, rows, kv_heads, capacity, head_dim]`` tensor, so the row dim has
a stride and the last two dims are contiguous. Lengths live on the device and are read there, so one CUDA graph
captured for a batch shape replays correctly as the lengths grow.

On CUDA with Triton importable the work runs as flash-decoding, in two kernels:

1. ``split``: grid ``(num_splits, kv_heads, rows)``. Each program takes one KV head of one row and one contiguous
   share of that row's filled length (the share is ``ceil(blocks(L) / num_splits)`` blocks of ``BLOCK_N``
   positions, computed on the device from ``lengths[r]``), and all query heads of that head's GQA group together,
   so each K/V block is loaded once for the whole group. It runs an online softmax in fp32 (exp2 domain) and
   writes its normalised partial output and its log-sum-exp. Programs whose share starts at or beyond
   ``lengths[r]`` run no loop iterations and store nothing, so the cost follows the filled length, not the
   capacity; positions at or beyond ``lengths[r]`` are never loaded (masked loads), so whatever sits there (stale
   rows, NaN) cannot leak into the result.
2. ``combine``: grid ``(q_heads, rows)``. Merges the active splits of one head by their log-sum-exps.

``num_splits`` follows the capacity alone (``_choose_num_splits``), so the launch grid is static and graph capturable,
and each share is at least ``split_blocks`` blocks (``max(split_blocks, ceil(blocks(L) / num_splits))``): a row's share
of its filled length, hence the order its positions are summed and merged in, depends on that length only, and a row's
result not on the other rows or on how many there are (batch invariance).

``append=(k_new, v_new, positions)`` also stores each row's new key and value at ``positions[r]`` of its slot
(what a decode step must do before attending). The Triton path does it inside ``split``, with no launch of its
own: the program whose share holds ``positions[r]`` (split 0 when the position lies in ``[lengths[r], capacity)``,
as for padded rows) stores them, and uses them in place of what its tile loaded from that position.

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

from .pdl import launch_options, uses_pdl

__all__ = ["Rotation", "decode_attention", "decode_attention_reference", "takes_rotation", "triton_available"]

_LOG2E = 1.4426950408889634


def _check_shapes(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor) -> tuple[int, int, int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"q must be [rows, q_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [rows, kv_heads, capacity, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    rows, q_heads, head_dim = q.shape
    c_rows, kv_heads, capacity, c_dim = k_cache.shape
    if c_rows != rows or c_dim != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if lengths.shape != (rows,):
        raise ValueError(f"lengths must be [rows] = [{rows}], got {tuple(lengths.shape)}")
    if lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths must be int32 or int64, got {lengths.dtype}")
    return rows, q_heads, kv_heads, capacity, head_dim


Append = tuple[Tensor, Tensor, Tensor]  # k_new, v_new [rows, kv_heads, head_dim]; positions [rows]


def _check_append(append: Append, k_cache: Tensor) -> None:
    k_new, v_new, positions = append
    rows, kv_heads, _, head_dim = k_cache.shape
    if k_new.shape != (rows, kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(
            f"append: k_new and v_new must both be [rows, kv_heads, head_dim] = {[rows, kv_heads, head_dim]}, got "
            f"{tuple(k_new.shape)} and {tuple(v_new.shape)}"
        )
    if positions.shape != (rows,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"append: positions must be int32/int64 [rows] = [{rows}], got {tuple(positions.shape)}")


Rotation = tuple[Tensor, Tensor, float, Tensor, Tensor]  # q_norm, k_norm [head_dim]; eps; cos, sin [rows, head_dim]


def _check_rotation(rotation: Rotation, q: Tensor, k_cache: Tensor, append: Append | None) -> None:
    """After _check_shapes."""
    if append is None:
        raise ValueError("decode_attention: rotation norms and rotates the appended key too; it needs append")
    q_norm, k_norm, _, cos, sin = rotation
    rows, _, _, head_dim = k_cache.shape
    if q_norm.shape != (head_dim,) or k_norm.shape != (head_dim,) or q_norm.stride(0) != 1 or k_norm.stride(0) != 1:
        raise ValueError(f"rotation: q_norm and k_norm must be contiguous [head_dim] = [{head_dim}], got "
                         f"{tuple(q_norm.shape)} and {tuple(k_norm.shape)}")
    if cos.shape != (rows, head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"rotation: cos and sin must be [rows, head_dim] = {[rows, head_dim]} with one layout and a "
                         f"contiguous last dim, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if not (q.dtype == k_cache.dtype == q_norm.dtype == k_norm.dtype):
        raise ValueError(f"rotation: q, the cache and the norm weights must share one dtype (the torch ops round to "
                         f"it), got {q.dtype}, {k_cache.dtype}, {q_norm.dtype} and {k_norm.dtype}")
    if any(t.device != q.device for t in (q_norm, k_norm, cos, sin)):
        raise ValueError("rotation: the norm weights and cos / sin must be on q's device")


def store_new_kv(k_cache: Tensor, v_cache: Tensor, append: Append) -> None:
    """The torch form of the append: row r's new key and value written at positions[r] of its slot."""
    k_new, v_new, positions = append
    rows = torch.arange(k_cache.shape[0], device=k_cache.device)
    k_cache[rows, :, positions] = k_new.to(k_cache.dtype)
    v_cache[rows, :, positions] = v_new.to(v_cache.dtype)


def decode_attention_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float | None = None,
    append: Append | None = None,
) -> Tensor:
    """Pure-torch decode attention: masked over the whole capacity, fp32 scores and softmax.

    Shapes as in ``decode_attention``. Positions at or beyond ``lengths[r]`` are masked out of the scores and
    zeroed in V, so garbage there (NaN, inf) cannot reach the output. No host sync."""
    rows, q_heads, kv_heads, capacity, head_dim = _check_shapes(q, k_cache, v_cache, lengths)
    if append is not None:
        _check_append(append, k_cache)
        store_new_kv(k_cache, v_cache, append)
    if scale is None:
        scale = head_dim**-0.5
    group = q_heads // kv_heads
    qf = q.float().reshape(rows, kv_heads, group, head_dim)
    valid = torch.arange(capacity, device=k_cache.device)[None, :] < lengths.to(k_cache.device)[:, None]  # [R, C]
    valid4 = valid[:, None, :, None]  # [R, 1, C, 1]
    kf = torch.where(valid4, k_cache.float(), 0.0)
    vf = torch.where(valid4, v_cache.float(), 0.0)
    scores = torch.einsum("rkgd,rkcd->rkgc", qf, kf) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    # A row with no valid position would softmax to NaN; give it zeros instead.
    any_valid = valid.any(dim=1)[:, None, None, None]
    scores = torch.where(any_valid, scores, 0.0)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("rkgc,rkcd->rkgd", probs, vf)
    out = torch.where(any_valid, out, 0.0)
    return out.reshape(rows, q_heads, head_dim).to(q.dtype)


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
        _check_shapes(q, k_cache, v_cache, lengths)
        if append is not None:
            _check_append(append, k_cache)
        _check_rotation(rotation, q, k_cache, append)
        raise ValueError("decode_attention: rotation needs the Triton path (CUDA tensors, Triton importable)")
    return decode_attention_reference(q, k_cache, v_cache, lengths, scale, append)


def takes_rotation(device: torch.device) -> bool:
    """Whether decode_attention on this device can norm and rotate q and the new key itself (``rotation``)."""
    return device.type == "cuda" and triton_available()


# --------------------------------------------------------------------------------------------------------------
# Triton path


@functools.cache
def _kernels():
    """Build the Triton kernels on first use (imports Triton)."""
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def norm_rotate(x_ptrs, partner_ptrs, mask, w_ptr, cos, sin, offs_d, eps, HEAD_DIM: tl.constexpr):
        """Rows of projections [.., HEAD_DIM] RMS-normed and rotated, rounding to the weight's dtype where torch
        does; partner_ptrs point at each element's rotation partner (d +- HEAD_DIM / 2)."""
        dtype = w_ptr.dtype.element_ty
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        partner = tl.load(partner_ptrs, mask=mask, other=0.0).to(tl.float32)
        inv_rms = libdevice.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / HEAD_DIM + eps)
        half = HEAD_DIM // 2
        partner_d = (offs_d + half) % HEAD_DIM
        w = tl.load(w_ptr + offs_d).to(tl.float32)
        w_partner = tl.load(w_ptr + partner_d).to(tl.float32)
        normed = (w * (x * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        normed_partner = (w_partner * (partner * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        rotated = tl.where(offs_d < half, -normed_partner, normed_partner)
        first = (normed * cos.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        second = (rotated * sin.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        return (first + second).to(dtype)

    @triton.jit
    def split_kernel(
        q_ptr, k_ptr, v_ptr, len_ptr, o_part_ptr, lse_part_ptr, out_ptr,
        k_new_ptr, v_new_ptr, pos_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr,
        stride_qr, stride_qh, stride_or, stride_oh,
        stride_kr, stride_kh, stride_kn,
        stride_vr, stride_vh, stride_vn,
        stride_knr, stride_knh, stride_vnr, stride_vnh, stride_rot,
        capacity, qk_scale_log2, eps,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        NUM_SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, APPEND: tl.constexpr,
        ROTATE: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # kernels/pdl.py: launched early, wait for the previous kernel before touching anything
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        split = tl.program_id(0)
        kvh = tl.program_id(1)
        row = tl.program_id(2)
        q_heads = tl.num_programs(1) * GROUP

        length = tl.load(len_ptr + row).to(tl.int32)
        length = tl.minimum(tl.maximum(length, 0), capacity)
        n_blocks = tl.cdiv(length, BLOCK_N)
        blocks_per_split = tl.maximum(tl.cdiv(n_blocks, NUM_SPLITS), SPLIT_BLOCKS)
        lo = split * blocks_per_split * BLOCK_N
        hi = tl.minimum(lo + blocks_per_split * BLOCK_N, length)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        heads = kvh * GROUP + offs_g

        row64 = row.to(tl.int64)
        q_rows = q_ptr + row64 * stride_qr + heads[:, None] * stride_qh
        if ROTATE:  # projections: norm and rotate as the torch ops do (module docstring)
            partner_d = (offs_d + HEAD_DIM // 2) % HEAD_DIM
            cos = tl.load(cos_ptr + row64 * stride_rot + offs_d)
            sin = tl.load(sin_ptr + row64 * stride_rot + offs_d)
            q = norm_rotate(q_rows + offs_d[None, :], q_rows + partner_d[None, :], g_mask[:, None], q_norm_ptr,
                            cos[None, :], sin[None, :], offs_d[None, :], eps, HEAD_DIM)
        else:
            q = tl.load(q_rows + offs_d[None, :], mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]

        k_base = k_ptr + row64 * stride_kr + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + row64 * stride_vr + kvh.to(tl.int64) * stride_vh

        if APPEND:  # this row's new key and value: stored by the program owning their position, used from registers
            pos = tl.load(pos_ptr + row).to(tl.int32)
            k_row = k_new_ptr + row64 * stride_knr + kvh * stride_knh
            if ROTATE:
                k_new = norm_rotate(k_row + offs_d, k_row + partner_d, offs_d < HEAD_DIM, k_norm_ptr, cos, sin, offs_d,
                                    eps, HEAD_DIM).to(k_ptr.dtype.element_ty)
            else:
                k_new = tl.load(k_row + offs_d).to(k_ptr.dtype.element_ty)
            v_new = tl.load(v_new_ptr + row64 * stride_vnr + kvh * stride_vnh + offs_d).to(v_ptr.dtype.element_ty)
            owner = ((lo <= pos) & (pos < hi)) | ((split == 0) & (pos >= length) & (pos < capacity))
            if owner:
                tl.store(k_base + pos.to(tl.int64) * stride_kn + offs_d, k_new)
                tl.store(v_base + pos.to(tl.int64) * stride_vn + offs_d, v_new)

        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

        for start in range(lo, hi, BLOCK_N):
            offs = start + offs_n
            n_mask = offs < hi
            k = tl.load(k_base + offs[:, None] * stride_kn + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            v = tl.load(v_base + offs[:, None] * stride_vn + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            if APPEND:
                is_new = ((offs == pos) & n_mask)[:, None]  # never into a masked column (garbage stays out)
                k = tl.where(is_new, k_new[None, :], k)
                v = tl.where(is_new, v_new[None, :], v)
            s = tl.dot(q, tl.trans(k)) * qk_scale_log2  # [GROUP_PAD, BLOCK_N], log2 domain
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        if NUM_SPLITS == 1:  # the whole row: the combine's result (weight exp2(0) = 1, zeros for no position), directly
            out_ptrs = out_ptr + row64 * stride_or + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:  # only splits that own at least one position store; the combine reads exactly those
            lse = m_i + tl.log2(l_safe)
            part_row = (row64 * q_heads + heads) * NUM_SPLITS + split  # [GROUP_PAD]
            st_mask = g_mask & (lo < hi)
            tl.store(lse_part_ptr + part_row, lse, mask=st_mask)
            tl.store(o_part_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=st_mask[:, None])

    @triton.jit
    def combine_kernel(
        o_part_ptr, lse_part_ptr, len_ptr, out_ptr,
        stride_or, stride_oh,
        capacity,
        HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
        SPLIT_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        head = tl.program_id(0)
        row = tl.program_id(1)
        q_heads = tl.num_programs(0)

        length = tl.load(len_ptr + row).to(tl.int32)
        length = tl.minimum(tl.maximum(length, 0), capacity)
        n_blocks = tl.cdiv(length, BLOCK_N)
        blocks_per_split = tl.maximum(tl.cdiv(n_blocks, NUM_SPLITS), SPLIT_BLOCKS)
        n_active = tl.cdiv(n_blocks, blocks_per_split)

        # Pass 1: the max and the sum of the weights over all active splits' log-sum-exps (scalars, cheap).
        offs_s = tl.arange(0, SPLITS_PAD)
        part_base = (row.to(tl.int64) * q_heads + head) * NUM_SPLITS
        lse_all = tl.load(lse_part_ptr + part_base + offs_s, mask=offs_s < n_active, other=float("-inf"))
        m = tl.max(lse_all, axis=0)
        m = tl.where(n_active > 0, m, 0.0)
        total = tl.sum(tl.where(offs_s < n_active, tl.exp2(lse_all - m), 0.0), axis=0)
        total = tl.where(total > 0, total, 1.0)
        # Pass 2: the weighted partial outputs, CHUNK splits at a time (keeps the tile small for many splits).
        offs_c = tl.arange(0, CHUNK)
        offs_d = tl.arange(0, HEAD_DIM)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for c0 in range(0, n_active, CHUNK):
            sp = c0 + offs_c
            c_mask = sp < n_active
            lse = tl.load(lse_part_ptr + part_base + sp, mask=c_mask, other=float("-inf"))
            w = tl.where(c_mask, tl.exp2(lse - m), 0.0)
            o = tl.load(o_part_ptr + (part_base + sp)[:, None] * HEAD_DIM + offs_d[None, :], mask=c_mask[:, None],
                        other=0.0)  # fmt: skip
            acc += tl.sum(o * w[:, None], axis=0)
        out = acc / total
        out_ptrs = out_ptr + row.to(tl.int64) * stride_or + head * stride_oh + offs_d
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))

    return triton, split_kernel, combine_kernel


# Defaults for Hopper (H100/H200), head_dim 128, bf16: K and V blocks of 64 positions, 4 warps, a 3-stage
# pipeline (bench/decode_attention.py --sweep on an H200: 36 layers, capacity 10240, rows 2 and 16, filled 1k/5k/10k;
# 2 stages cost up to 35% more). A row's filled length is split into at most 8 shares of at least 4 blocks (256
# positions), whatever the rows beside it. An H200 sweep of split counts (36 layers, rows 2 and 16, filled 384, 1024
# and 4096; bench/batch_invariance_ab.py) picked these: two rows want many splits (6-8 at 384 positions: 5.7-6.3 us a
# layer against 8.1 for one), sixteen few (one or two at 384: 10.0-11.4 us against 17.0 for eight). Shares of 4 blocks
# keep both within 1 us a layer of the earlier row-count rule at a few hundred positions; at 1024-4096 positions
# sixteen rows take 5-6 us a layer more (8 splits where the row-count rule took 2), and 8 splits keep a full one-song
# step at 128 programs, about one per SM.
_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 3
_MAX_SPLITS = 8
_SPLIT_BLOCKS = 4


def _choose_num_splits(capacity: int, block_n: int, split_blocks: int = _SPLIT_BLOCKS) -> int:
    """Split programs per (row, kv_head): _MAX_SPLITS, fewer when the capacity holds fewer shares of split_blocks
    blocks. A function of the capacity alone: each row's share is then max(split_blocks, ceil(blocks(L) / _MAX_SPLITS))
    blocks of its filled length L, whatever the other rows (and whatever the capacity: a smaller one gives every
    length it can hold shares of split_blocks)."""
    return max(1, min(_MAX_SPLITS, math.ceil(capacity / (block_n * split_blocks))))


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
    append: Append | None = None,
    rotation: Rotation | None = None,
) -> Tensor:
    rows, q_heads, kv_heads, capacity, head_dim = _check_shapes(q, k_cache, v_cache, lengths)
    if append is not None:
        _check_append(append, k_cache)
    if rotation is not None:
        _check_rotation(rotation, q, k_cache, append)
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

    triton, split_kernel, combine_kernel = _kernels()
    group = q_heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    if num_splits is None:
        num_splits = _choose_num_splits(capacity, block_n, split_blocks)
    splits_pad = max(2, triton.next_power_of_2(num_splits))

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

    split_kernel[(num_splits, kv_heads, rows)](
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
