"""Decode attention's split and combine kernels under the interpreter: the reference's result over mixed lengths (masked
tails, empty rows, more splits than blocks, GQA groups, garbage past each length), the append path bit for bit as
storing first, and the rotation path with the torch ops' bits."""

from __future__ import annotations

import pytest
import torch

from music3serve.kernels.decode_attention import _decode_attention_triton
from music3serve.kernels.decode_attention_reference import decode_attention_reference, store_new_kv
from music3serve.models.layers import apply_rope, rms_norm, rope_angles

# GQA groups of 4, as the talker's 32 / 8 heads; blocks of 16 positions, so a capacity of 100 holds 7 blocks, the last
# one partial. Lengths: empty, one, either side of a block edge, a partial last block, full.
Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY, BLOCK_N = 8, 2, 32, 100, 16
LENGTHS = [0, 1, 15, 16, 17, 63, 90, 100]


def caches(rows: int, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 K and V of one layer of a [layers, rows, kv_heads, capacity, head_dim] cache: rows carry a stride."""
    k, v = (torch.randn(2, rows, kv_heads, CAPACITY, head_dim).to(torch.bfloat16) for _ in range(2))
    return k[1], v[1]


def within_roundings(out: torch.Tensor, q, k, v, lengths, scale=None) -> None:
    """The kernel rounds each softmax weight to bf16 before the product with V (2^-9 relative: at most 2^-9 of
    sum p |v|) and the output once (2^-9 of it); everything else is float32 in another order than the reference's
    (~1e-6). Twice those roundings; a wrong mask, split or scale is off by far more."""
    exact = decode_attention_reference(q.float(), k, v, lengths, scale)
    weighted_abs = decode_attention_reference(q.float(), k, v.abs(), lengths, scale)
    bound = 2.0**-8 * (exact.abs() + weighted_abs) + 1e-6
    assert ((out.float() - exact).abs() <= bound).all(), (out.float() - exact).abs().max()


@pytest.mark.parametrize("splits", [1, 3, 8])  # 8: more splits than the 7 blocks, some always idle
def test_the_kernels_give_the_references_result(splits):
    rows = len(LENGTHS)
    k, v = caches(rows)
    q = torch.randn(rows, Q_HEADS, HEAD_DIM).to(torch.bfloat16)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    out = _decode_attention_triton(q, k, v, lengths, num_splits=splits, block_n=BLOCK_N)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    within_roundings(out, q, k, v, lengths)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # an empty row gives zeros
    for r, n in enumerate(LENGTHS):  # garbage past each length changes nothing, bit for bit
        k[r, :, n:] = float("nan")
        v[r, :, n:] = float("inf")
    assert torch.equal(_decode_attention_triton(q, k, v, lengths, num_splits=splits, block_n=BLOCK_N), out)


def test_the_program_count_changes_no_bit():
    """Programs take a row's shares in turn: from one program running all 7 shares of a full row to one per share,
    the output and the appended keys and values are the same bits (the shares, not the programs, fix the arithmetic)."""
    rows = len(LENGTHS)
    k, v = caches(rows)
    q = torch.randn(rows, Q_HEADS, HEAD_DIM).to(torch.bfloat16)
    k_new, v_new = (torch.randn(rows, KV_HEADS, HEAD_DIM).to(torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([max(n, 1) for n in LENGTHS], dtype=torch.int32)
    append = (k_new, v_new, (lengths - 1).long())
    results = {}
    for programs in (1, 2, 3, 5, 8):
        k_run, v_run = k.clone(), v.clone()
        out = _decode_attention_triton(q, k_run, v_run, lengths, num_splits=8, split_blocks=1, programs=programs,
                                       block_n=BLOCK_N, append=append)
        results[programs] = (out, k_run, v_run)
    within_roundings(results[1][0], q, results[1][1], results[1][2], lengths)
    for programs, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, results[8])), f"{programs} programs"


@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 4, 16), (32, 8, 128)], ids=["no GQA", "the talker's"])
def test_other_groups_and_head_dims(q_heads, kv_heads, head_dim):
    k, v = caches(3, kv_heads, head_dim)
    q = torch.randn(3, q_heads, head_dim).to(torch.bfloat16)
    lengths = torch.tensor([1, 40, 100], dtype=torch.int32)
    out = _decode_attention_triton(q, k, v, lengths, num_splits=3, block_n=BLOCK_N)
    within_roundings(out, q, k, v, lengths)


def test_float32_queries_int64_lengths_and_a_scale():
    rows = 3
    k, v = caches(rows)
    q = torch.randn(rows, Q_HEADS, HEAD_DIM)
    lengths = torch.tensor([33, 100, 7])
    out = _decode_attention_triton(q, k, v, lengths, scale=0.05, num_splits=4, block_n=BLOCK_N)
    assert out.dtype == torch.float32
    within_roundings(out, q.bfloat16(), k, v, lengths, scale=0.05)  # q is rounded to the cache's dtype for tl.dot


@pytest.mark.parametrize("splits", [1, 3])
def test_append_is_storing_first_then_attending(splits):
    """Rows at their last position in any split, a padded row writing its scratch position with length 1, and an inf
    value stored past a row's length inside its first tile, which must not reach the output."""
    rows = 6
    k, v = caches(rows)
    q = torch.randn(rows, Q_HEADS, HEAD_DIM).to(torch.bfloat16)
    k_new, v_new = (torch.randn(rows, KV_HEADS, HEAD_DIM).to(torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([1, 16, 17, 64, 100, 9], dtype=torch.int32)
    positions = (lengths - 1).long()
    positions[1], lengths[1] = CAPACITY - 1, 1  # padded: the scratch position
    positions[5], v_new[5] = 11, float("inf")  # past its length (9), inside the first tile
    k_first, v_first = k.clone(), v.clone()
    store_new_kv(k_first, v_first, (k_new, v_new, positions))
    expected = _decode_attention_triton(q, k_first, v_first, lengths, num_splits=splits, block_n=BLOCK_N)
    out = _decode_attention_triton(q, k, v, lengths, num_splits=splits, block_n=BLOCK_N,
                                   append=(k_new, v_new, positions))
    assert torch.equal(out, expected) and out.isfinite().all()
    assert torch.equal(k, k_first) and torch.equal(v, v_first)


def test_append_stores_nothing_outside_the_slot():
    """A position below 0 or at the capacity is stored nowhere: not before the row's slot (the previous head's or
    row's last position), not after it."""
    rows = 3
    k, v = caches(rows)
    q = torch.randn(rows, Q_HEADS, HEAD_DIM).to(torch.bfloat16)
    k_new, v_new = (torch.randn(rows, KV_HEADS, HEAD_DIM).to(torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([5, 5, 5], dtype=torch.int32)
    positions = torch.tensor([-1, CAPACITY, -1])
    k_before, v_before = k.clone(), v.clone()
    _decode_attention_triton(q, k, v, lengths, block_n=BLOCK_N, append=(k_new, v_new, positions))
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


@pytest.mark.parametrize("splits", [1, 3])
def test_rotation_gives_the_torch_ops_bits(splits):
    """q and the new keys as projections, RMS-normed and rotated inside the kernel: the stored keys and the output are
    those of the torch ops' rotated inputs through the same kernel. Small integers keep every float32 sum of squares
    exact in any order; one row scaled by 2**-12 has a mean square about eps."""
    rows, width = 4, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    k, v = caches(rows)
    qkv = torch.randint(-8, 9, (rows, width)).to(torch.bfloat16)
    qkv[2] *= 2**-12
    q, k_new, v_new = (p.view(rows, -1, HEAD_DIM) for p in qkv.split(
        [Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1))
    q_norm, k_norm = ((1 + 0.2 * torch.randn(HEAD_DIM)).to(torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([5, 1, 77, 100])
    positions = lengths - 1
    positions[1] = CAPACITY - 1  # padded: the scratch position
    cos, sin = rope_angles(positions[:, None], HEAD_DIM, 1_000_000.0)
    q_rot = apply_rope(rms_norm(q[:, None], q_norm, 1e-6), cos, sin)[:, 0]
    k_rot = apply_rope(rms_norm(k_new[:, None], k_norm, 1e-6), cos, sin)[:, 0]
    k_torch, v_torch = k.clone(), v.clone()
    expected = _decode_attention_triton(q_rot, k_torch, v_torch, lengths, num_splits=splits, block_n=BLOCK_N,
                                        append=(k_rot, v_new, positions))
    rotation = (q_norm, k_norm, 1e-6, cos[:, 0].contiguous(), sin[:, 0].contiguous())
    out = _decode_attention_triton(q, k, v, lengths, num_splits=splits, block_n=BLOCK_N,
                                   append=(k_new, v_new, positions), rotation=rotation)
    assert torch.equal(k, k_torch) and torch.equal(v, v_torch)
    assert torch.equal(out, expected)


def test_with_the_split_count_fixed_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    """Each program reads one row only; a row's result changes with its company only through the split count."""
    k, v = caches(len(LENGTHS))
    q = torch.randn(len(LENGTHS), Q_HEADS, HEAD_DIM).to(torch.bfloat16)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    full = _decode_attention_triton(q, k, v, lengths, num_splits=3, block_n=BLOCK_N)
    for rows in (slice(6, 7), slice(2, 5)):
        alone = _decode_attention_triton(q[rows], k[rows], v[rows], lengths[rows], num_splits=3, block_n=BLOCK_N)
        assert torch.equal(alone, full[rows])
