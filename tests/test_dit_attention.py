"""The DiT's attention: the torch reference on the CPU is softmax attention; the Triton kernel (GPU) is as close to
the exact result as torch's own bf16 SDPA, bit for bit the same alone or batched, and the same under graph replay."""

from __future__ import annotations

import pytest
import torch

from music3serve.kernels.dit_attention import dit_attention, dit_attention_reference, uses_kernel


def qkv_views(batch, tokens, heads, head_dim, dtype, device="cpu", seed=0):
    """q, k, v [batch, tokens, heads, head_dim] as split_rope leaves them: strided views of one fused buffer."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, tokens, 3 * heads * head_dim, generator=gen).to(device, dtype)
    return qkv.view(batch, tokens, 3, heads, head_dim).unbind(2)


def exact_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v in float64, written out; [batch, tokens, heads * head_dim]."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    out = (weights @ v).transpose(1, 2)
    return out.reshape(*out.shape[:2], -1)


def test_cpu_is_softmax_attention_in_the_o_projections_layout():
    q, k, v = qkv_views(2, 9, 3, 16, torch.float32)
    out = dit_attention(q, k, v)
    assert out.shape == (2, 9, 48) and out.is_contiguous()
    torch.testing.assert_close(out.double(), exact_attention(q, k, v), rtol=1e-5, atol=1e-6)
    assert torch.equal(out, dit_attention_reference(q, k, v))


def test_mismatched_shapes_are_refused():
    q, k, v = qkv_views(1, 5, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="one shape"):
        dit_attention(q, k[:, :4], v)
    with pytest.raises(ValueError, match="one shape"):
        dit_attention(q[0], k[0], v[0])


GPU_SHAPES = [  # batch, tokens, heads, head_dim
    (2, 690, 32, 64),  # one full-size window, cond + uncond
    (2, 1, 32, 64),  # a one-column window
    (3, 63, 4, 64),
    (3, 64, 4, 64),
    (3, 65, 4, 64),
    (2, 200, 2, 128),
    (2, 129, 2, 16),  # the tiny DiT's head_dim
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_is_as_close_to_exact_as_torchs_sdpa(shape, dtype):
    q, k, v = qkv_views(*shape, dtype, "cuda", seed=shape[1])
    assert uses_kernel(q, k, v)  # the kernel, not the fallback, is what is measured
    exact = exact_attention(q, k, v)
    ours = dit_attention(q, k, v)
    torchs = dit_attention_reference(q, k, v)
    assert ours.shape == exact.shape and ours.dtype == dtype and ours.is_contiguous()
    ours_err = (ours.double() - exact).abs().max().item()
    torch_err = (torchs.double() - exact).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-3 * exact.abs().max().item()


@pytest.mark.gpu
def test_kernel_window_is_bitwise_the_same_alone_and_batched():
    q, k, v = qkv_views(16, 690, 32, 64, torch.bfloat16, "cuda")
    assert uses_kernel(q, k, v)
    batched = dit_attention(q, k, v)
    for i in (0, 7, 15):
        alone = dit_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1])
        assert torch.equal(alone[0], batched[i])


@pytest.mark.gpu
def test_graph_replay_equals_eager():
    q, k, v = qkv_views(2, 690, 32, 64, torch.bfloat16, "cuda")
    assert uses_kernel(q, k, v)
    dit_attention(q, k, v)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dit_attention(q, k, v)
    q.mul_(-0.5)
    graph.replay()
    assert torch.equal(out, dit_attention(q, k, v))


def fallback_cases():
    """Operands the kernel does not take, each with the rule it breaks."""
    wide = qkv_views(2, 50, 2, 256, torch.bfloat16, "cuda")
    views = qkv_views(2, 40, 2, 64, torch.bfloat16, "cuda")
    strided = tuple(x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in views)  # head_dim stride 2
    return {
        "float32 (the reference policy)": qkv_views(2, 100, 4, 64, torch.float32, "cuda"),
        "head_dim 256": wide,
        "head_dim 80, not a power of two": qkv_views(2, 40, 2, 80, torch.bfloat16, "cuda"),
        "head_dim 8, under 16": qkv_views(2, 40, 2, 8, torch.bfloat16, "cuda"),
        "head_dim not of unit stride": strided,
        "no tokens": qkv_views(2, 0, 2, 64, torch.bfloat16, "cuda"),
        "over 65535 (batch, head) pairs": qkv_views(1025, 1, 64, 16, torch.bfloat16, "cuda"),
    }


@pytest.mark.gpu
def test_operands_of_two_dtypes_or_devices_are_not_taken():
    q, k, v = qkv_views(2, 40, 2, 64, torch.bfloat16, "cuda")
    assert uses_kernel(q, k, v)
    assert not uses_kernel(q, k, v.half())
    assert not uses_kernel(q, k.cpu(), v)


@pytest.mark.gpu
def test_operands_the_kernel_does_not_take_keep_torchs_sdpa():
    for name, (q, k, v) in fallback_cases().items():
        assert not uses_kernel(q, k, v), name
        assert torch.equal(dit_attention(q, k, v), dit_attention_reference(q, k, v)), name
