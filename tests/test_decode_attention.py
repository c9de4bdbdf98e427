"""Decode attention over filled KV rows: the torch reference against a naive SDPA loop (CPU), and the Triton
kernel against the reference on a GPU (lengths 1..10240, mixed batches, garbage past the length, graph replay)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from music3serve.kernels import decode_attention, decode_attention_reference, triton_available
from music3serve.kernels.decode_attention import _decode_attention_triton
from music3serve.kernels.decode_attention_reference import store_new_kv

# Qwen3-8B talker attention: 32 query heads over 8 KV heads (GQA group 4), head_dim 128.
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128

gpu = pytest.mark.gpu
# tests/conftest.py skips `gpu` tests without CUDA; this also covers running with --noconftest.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _layered_cache(layers, rows, kv_heads, capacity, head_dim, *, dtype, device, generator):
    """K and V as the engine holds them: [layers, rows, kv_heads, capacity, head_dim]."""
    shape = (layers, rows, kv_heads, capacity, head_dim)
    k = torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
    return k, v


def _naive(q, k_cache, v_cache, lengths, scale=None):
    """One row at a time: SDPA over cache[:length], K/V heads repeated for GQA, all in fp32."""
    rows, q_heads, _ = q.shape
    group = q_heads // k_cache.shape[1]
    outs = []
    for r in range(rows):
        n = int(lengths[r])
        k = k_cache[r, :, :n].float().repeat_interleave(group, dim=0)  # [q_heads, n, D]
        v = v_cache[r, :, :n].float().repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(q[r].float()[:, None, :], k, v, scale=scale)  # [q_heads, 1, D]
        outs.append(o[:, 0])
    return torch.stack(outs)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# ----------------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(Q_HEADS, KV_HEADS, HEAD_DIM), (8, 2, 32), (4, 4, 16)])
def test_reference_matches_naive_sdpa_loop(q_heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(0)
    rows, capacity = 5, 67
    k_all, v_all = _layered_cache(3, rows, kv_heads, capacity, head_dim, dtype=torch.float32, device="cpu", generator=g)
    k, v = k_all[1], v_all[1]  # a per-layer view: rows carry a stride
    q = torch.randn(rows, q_heads, head_dim, generator=g)
    lengths = torch.tensor([1, 2, 17, 66, 67], dtype=torch.int32)
    ref = decode_attention_reference(q, k, v, lengths)
    torch.testing.assert_close(ref, _naive(q, k, v, lengths), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        decode_attention_reference(q, k, v, lengths.long(), scale=0.3), _naive(q, k, v, lengths, scale=0.3),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    # The CPU dispatch is the reference.
    torch.testing.assert_close(decode_attention(q, k, v, lengths), ref, rtol=0, atol=0)


def test_reference_ignores_garbage_past_length_and_keeps_dtype():
    g = torch.Generator().manual_seed(1)
    rows, capacity = 4, 40
    k_all, v_all = _layered_cache(2, rows, KV_HEADS, capacity, HEAD_DIM, dtype=torch.bfloat16, device="cpu", generator=g)
    k, v = k_all[0], v_all[0]
    q = torch.randn(rows, Q_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    lengths = torch.tensor([3, 40, 1, 25], dtype=torch.int64)
    clean = decode_attention_reference(q, k, v, lengths)
    assert clean.dtype == torch.bfloat16 and clean.shape == q.shape
    for r, n in enumerate(lengths.tolist()):
        k[r, :, n:] = float("nan")
        v[r, :, n:] = float("inf")
    dirty = decode_attention_reference(q, k, v, lengths)
    assert torch.equal(clean, dirty)
    torch.testing.assert_close(clean.float(), _naive(q, k, v, lengths), rtol=2e-2, atol=2e-2)


def test_reference_zero_length_row_gives_zeros():
    q = torch.randn(2, 8, 32)
    k = torch.randn(2, 2, 10, 32)
    v = torch.randn(2, 2, 10, 32)
    out = decode_attention_reference(q, k, v, torch.tensor([0, 4]))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], _naive(q[1:], k[1:], v[1:], torch.tensor([4])), rtol=1e-5, atol=1e-5)


def test_reference_append_stores_the_new_rows_then_attends():
    """append=(k_new, v_new, positions) equals writing the rows first: at each row's last position, and at a
    padded row's scratch position (beyond its length); nothing else in the cache changes."""
    g = torch.Generator().manual_seed(3)
    rows, capacity = 3, 40
    k_all, v_all = _layered_cache(2, rows, 4, capacity, 16, dtype=torch.float32, device="cpu", generator=g)
    q = torch.randn(rows, 8, 16, generator=g)
    k_new, v_new = torch.randn(rows, 4, 16, generator=g), torch.randn(rows, 4, 16, generator=g)
    lengths, positions = torch.tensor([5, 17, 1]), torch.tensor([4, 16, capacity - 1])
    expected_k, expected_v = k_all[1].clone(), v_all[1].clone()
    for r, p in enumerate(positions.tolist()):
        expected_k[r, :, p], expected_v[r, :, p] = k_new[r], v_new[r]
    expected = decode_attention_reference(q, expected_k, expected_v, lengths)
    out = decode_attention_reference(q, k_all[1], v_all[1], lengths, append=(k_new, v_new, positions))
    assert torch.equal(out, expected)
    assert torch.equal(k_all[1], expected_k) and torch.equal(v_all[1], expected_v)
    with pytest.raises(ValueError, match="append"):
        decode_attention_reference(q, k_all[1], v_all[1], lengths, append=(k_new[:2], v_new, positions))


def test_module_imports_and_shape_errors():
    with pytest.raises(ValueError):
        decode_attention_reference(torch.randn(2, 6, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16),
                                   torch.tensor([1, 1]))  # fmt: skip
    with pytest.raises(ValueError):
        decode_attention_reference(torch.randn(2, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16),
                                   torch.tensor([1.0, 1.0]))  # fmt: skip
    assert isinstance(triton_available(), bool)


def test_a_rotation_is_checked_and_refused_off_the_triton_path():
    """q and key projections to norm and rotate need the new key (append), [head_dim] norm weights and cos / sin
    [rows, head_dim] in the cache's dtype, and the Triton kernel: on the CPU the caller rotates them itself."""
    rows, heads, capacity, dim = 2, 2, 8, 16
    q, k_cache = torch.randn(rows, heads, dim), torch.randn(rows, heads, capacity, dim)
    new = (torch.randn(rows, heads, dim), torch.randn(rows, heads, dim), torch.tensor([0, 3]))
    lengths, weight, angles = torch.tensor([1, 4]), torch.ones(dim), torch.zeros(rows, dim)
    with pytest.raises(ValueError, match="needs append"):
        decode_attention(q, k_cache, k_cache.clone(), lengths, rotation=(weight, weight, 1e-6, angles, angles))
    with pytest.raises(ValueError, match=r"q_norm and k_norm must be contiguous \[head_dim\]"):
        decode_attention(q, k_cache, k_cache.clone(), lengths, append=new,
                         rotation=(torch.ones(dim + 1), weight, 1e-6, angles, angles))
    with pytest.raises(ValueError, match=r"q_norm and k_norm must be contiguous"):  # the kernel reads w[d] at d
        decode_attention(q, k_cache, k_cache.clone(), lengths, append=new,
                         rotation=(weight, torch.ones(2 * dim)[::2], 1e-6, angles, angles))
    with pytest.raises(ValueError, match=r"cos and sin must be \[rows, head_dim\]"):
        decode_attention(q, k_cache, k_cache.clone(), lengths, append=new,
                         rotation=(weight, weight, 1e-6, angles[:, None], angles))
    with pytest.raises(ValueError, match="share one dtype"):
        decode_attention(q, k_cache, k_cache.clone(), lengths, append=new,
                         rotation=(weight.double(), weight, 1e-6, angles, angles))
    with pytest.raises(ValueError, match="needs the Triton path"):
        decode_attention(q, k_cache, k_cache.clone(), lengths, append=new, rotation=(weight, weight, 1e-6, angles, angles))


# ----------------------------------------------------------------------------------------------------- GPU

_LENGTHS = [1, 2, 15, 16, 17, 127, 128, 1000, 4095, 4096, 5000, 10239, 10240]
_CAPACITY = 10240


def _gpu_setup(rows, capacity=_CAPACITY, layers=2, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k_all, v_all = _layered_cache(layers, rows, KV_HEADS, capacity, HEAD_DIM, dtype=torch.bfloat16, device="cuda",
                                  generator=g)  # fmt: skip
    q = torch.randn(rows, Q_HEADS, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
    return q, k_all[layers - 1], v_all[layers - 1]


def _oracle(q, k, v, lengths):
    """The reference in fp32 on the bf16 inputs (no output rounding)."""
    return decode_attention_reference(q.float(), k, v, lengths)


@gpu
@needs_cuda
@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize("length", _LENGTHS)
def test_triton_matches_reference_per_length(length):
    rows = 2
    q, k, v = _gpu_setup(rows, seed=length)
    lengths = torch.full((rows,), length, dtype=torch.int32, device="cuda")
    lengths[1] = max(1, length // 2)
    out = decode_attention(q, k, v, lengths)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    err = _rel_err(out, _oracle(q, k, v, lengths))
    print(f"length {length}: rel err {err:.2e}")
    assert err < 1e-2


@gpu
@needs_cuda
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_triton_mixed_lengths_garbage_and_explicit_splits():
    rows = 16
    q, k, v = _gpu_setup(rows, layers=3, seed=123)
    lengths = torch.tensor(_LENGTHS + [3, 64, 9000], dtype=torch.int32, device="cuda")
    assert lengths.numel() == rows
    ref = _oracle(q, k, v, lengths)
    out = decode_attention(q, k, v, lengths)
    err = _rel_err(out, ref)
    print(f"mixed 16 rows: rel err {err:.2e}")
    assert err < 1e-2
    # int64 lengths and a custom scale
    out64 = decode_attention(q, k, v, lengths.long(), scale=0.05)
    assert _rel_err(out64, decode_attention_reference(q.float(), k, v, lengths, scale=0.05)) < 1e-2
    # other split counts and block sizes give the same answer
    for splits, block_n in [(1, 64), (3, 32), (64, 64), (160, 128)]:
        o = _decode_attention_triton(q, k, v, lengths, num_splits=splits, block_n=block_n)
        assert _rel_err(o, ref) < 1e-2, (splits, block_n)
    # garbage past each length changes nothing, bit for bit
    for r, n in enumerate(lengths.tolist()):
        k[r, :, n:] = float("nan")
        v[r, :, n : n + 7] = float("inf")
        v[r, :, n + 7 :] = 3e38
    assert torch.equal(decode_attention(q, k, v, lengths), out)


@gpu
@needs_cuda
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_triton_cuda_graph_replay_with_new_lengths():
    rows = 16
    q, k, v = _gpu_setup(rows, seed=7)
    static_q = q.clone()
    static_lengths = torch.randint(1, 200, (rows,), dtype=torch.int32, device="cuda")
    decode_attention(static_q, k, v, static_lengths)  # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(static_q, k, v, static_lengths)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = decode_attention(static_q, k, v, static_lengths)
    g = torch.Generator(device="cuda").manual_seed(99)
    for new_lengths in ([_CAPACITY] * rows, [1] * rows, torch.randint(1, _CAPACITY + 1, (rows,)).tolist()):
        static_lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        static_q.copy_(torch.randn(q.shape, generator=g, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        eager = decode_attention(static_q, k, v, static_lengths)
        assert torch.equal(static_out, eager)
        assert _rel_err(static_out, _oracle(static_q, k, v, static_lengths)) < 1e-2


@gpu
@needs_cuda
@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_triton_append_equals_storing_first(splits):
    """The kernel's own store of the new keys and values: the output is bit-identical to storing them first and
    then attending, and the caches end up identical (rows at their last position, in any split, a padded row at
    the scratch position with length 1, and an inf value stored past a row's length, which must not reach its
    output)."""
    rows = 16
    q, k, v = _gpu_setup(rows, seed=11)
    g = torch.Generator(device="cuda").manual_seed(12)
    k_new = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
    v_new = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
    lengths = torch.tensor([1, 2, 63, 64, 65, 128, 129, 1000, 4097, 9999, 10240, 1, 1, 300, 5000, 777],
                           dtype=torch.int32, device="cuda")  # fmt: skip
    positions = (lengths - 1).long()
    positions[11] = _CAPACITY - 1  # a padded row: scratch position, length 1
    positions[12], v_new[12] = 5, float("inf")  # a position past the length inside the first tile: stays out
    k_first, v_first = k.clone(), v.clone()
    store_new_kv(k_first, v_first, (k_new, v_new, positions))
    expected = _decode_attention_triton(q, k_first, v_first, lengths, num_splits=splits)
    out = _decode_attention_triton(q, k, v, lengths, num_splits=splits, append=(k_new, v_new, positions))
    assert torch.equal(out, expected)
    assert torch.equal(k, k_first) and torch.equal(v, v_first)


@gpu
@needs_cuda
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_a_pdl_launch_waits_for_a_producer_that_lets_it_start_early(late_copy):
    """The producer of q lets the attention start at once and writes q only 100 us later: read before gdc_wait, q
    would still be zeros."""
    rows = 2
    q, k, v = _gpu_setup(rows, seed=21)
    g = torch.Generator(device="cuda").manual_seed(22)
    k_new, v_new = (torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
                    for _ in range(2))  # fmt: skip
    lengths = torch.tensor([700, 5000], dtype=torch.int32, device="cuda")
    positions = (lengths - 1).long()
    k_expected, v_expected = k.clone(), v.clone()
    expected = _decode_attention_triton(q, k_expected, v_expected, lengths, append=(k_new, v_new, positions))
    k_new, v_new = late_copy(k_new), late_copy(v_new)
    q_late = late_copy(q)  # the kernel just before the attention
    out = _decode_attention_triton(q_late, k, v, lengths, append=(k_new, v_new, positions))
    assert torch.equal(out, expected)
    assert torch.equal(k, k_expected) and torch.equal(v, v_expected)


@gpu
@needs_cuda
@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize("splits", [None, 1, 7])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(Q_HEADS, KV_HEADS, HEAD_DIM), (8, 8, 64)])
def test_triton_rotation_rounds_as_the_torch_ops(splits, q_heads, kv_heads, head_dim):
    """Projections normed and rotated inside the kernel (a Qwen3 layer's q/k RMS norms and RoPE) give the torch ops'
    bits: the stored keys, and the output of attending with the torch ops' rotated q and keys through the same kernel.
    The projections are small integers, so that every float32 sum of squares is exact in any order (the one place the
    kernel may add in another order than torch); one row's are scaled by 2**-12, so that its mean square is about eps
    and a kernel without eps would differ there. q and the new keys are strided views of one qkv buffer, as the
    layer's GEMM leaves them, and one padded row writes past its length."""
    from music3serve.models.layers import apply_rope, rms_norm, rope_angles

    rows, width = 16, (q_heads + 2 * kv_heads) * head_dim
    g = torch.Generator(device="cuda").manual_seed(22)
    k, v = (torch.randn(rows, kv_heads, _CAPACITY, head_dim, generator=g, device="cuda").to(torch.bfloat16)
            for _ in range(2))  # fmt: skip
    qkv = torch.randint(-8, 9, (rows, width), generator=g, device="cuda").to(torch.bfloat16)
    qkv[5] *= 2**-12  # exact in bf16: mean squares of ~1e-6, the size of eps
    q, k_new, v_new = (p.view(rows, -1, head_dim) for p in qkv.split([q_heads * head_dim, kv_heads * head_dim,
                                                                      kv_heads * head_dim], dim=-1))
    q_norm = (1 + 0.2 * torch.randn(head_dim, generator=g, device="cuda")).to(torch.bfloat16)
    k_norm = (1 + 0.2 * torch.randn(head_dim, generator=g, device="cuda")).to(torch.bfloat16)
    lengths = torch.randint(1, _CAPACITY + 1, (rows,), generator=g, device="cuda")
    positions = lengths - 1
    positions[3], lengths[3] = _CAPACITY - 1, 1  # a padded row: the scratch position, length 1
    cos, sin = rope_angles(positions[:, None], head_dim, 1_000_000.0)
    q_rot = apply_rope(rms_norm(q[:, None], q_norm, 1e-6), cos, sin)[:, 0]
    k_rot = apply_rope(rms_norm(k_new[:, None], k_norm, 1e-6), cos, sin)[:, 0]
    k_torch, v_torch = k.clone(), v.clone()
    expected = _decode_attention_triton(q_rot, k_torch, v_torch, lengths, num_splits=splits,
                                        append=(k_rot, v_new, positions))
    rotation = (q_norm, k_norm, 1e-6, cos[:, 0].contiguous(), sin[:, 0].contiguous())
    if splits is None:
        out = decode_attention(q, k, v, lengths, append=(k_new, v_new, positions), rotation=rotation)
    else:
        out = _decode_attention_triton(q, k, v, lengths, num_splits=splits, append=(k_new, v_new, positions),
                                       rotation=rotation)
    assert torch.equal(k, k_torch) and torch.equal(v, v_torch)
    assert torch.equal(out, expected)
