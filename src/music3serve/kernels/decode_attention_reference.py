"""Decode attention's input checks and its pure-torch form: the path off CUDA and the test oracle.

Shapes and semantics as in kernels/decode_attention.py, which runs the Triton kernels on CUDA."""

import torch
from torch import Tensor

__all__ = ["Append", "Rotation", "check_append", "check_rotation", "check_shapes", "decode_attention_reference",
           "store_new_kv"]


def check_shapes(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor) -> tuple[int, int, int, int, int]:
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


def check_append(append: Append, k_cache: Tensor) -> None:
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


def check_rotation(rotation: Rotation, q: Tensor, k_cache: Tensor, append: Append | None) -> None:
    """After check_shapes."""
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
    rows, q_heads, kv_heads, capacity, head_dim = check_shapes(q, k_cache, v_cache, lengths)
    if append is not None:
        check_append(append, k_cache)
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
