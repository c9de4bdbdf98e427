"""split_rope: q, k, v are views of qkv, rotated in place; the Triton kernel (GPU) stays within the rounding of
the torch ops; the torch path equals an independent rotation written with complex numbers."""

from __future__ import annotations

import pytest
import torch

from music3serve.kernels.split_rope import split_rope, split_rope_reference
from music3serve.models.layers import rope_angles

SHAPES = [  # batch, tokens, heads, head_dim, rotary_dim
    (2, 690, 32, 64, 32),  # the full-size DiT
    (1, 5, 2, 16, 8),  # the tiny DiT
    (3, 17, 3, 24, 24),  # heads and head_dim not powers of two, whole head rotated
]


def inputs(batch, tokens, heads, head_dim, rot, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(batch, tokens, 3 * heads * head_dim, generator=gen).to(device, dtype)
    cos, sin = rope_angles(torch.arange(tokens, device=device), rot, 10_000.0)
    return qkv, cos, sin


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_is_a_complex_rotation_of_the_first_dims(shape):
    batch, tokens, heads, head_dim, rot = shape
    qkv, cos, sin = inputs(*shape, torch.float64)
    parts = qkv.clone().view(batch, tokens, 3, heads, head_dim)
    q, k, v = split_rope(qkv, cos.double(), sin.double(), heads)
    assert_views_of(qkv, q, k, v)
    angle = torch.atan2(sin[:, : rot // 2], cos[:, : rot // 2]).double()[None, :, None]
    for got, x in ((q, parts[:, :, 0]), (k, parts[:, :, 1])):
        z = torch.complex(x[..., : rot // 2], x[..., rot // 2 : rot]) * torch.polar(torch.ones_like(angle), angle)
        torch.testing.assert_close(got[..., : rot // 2], z.real, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[..., rot // 2 : rot], z.imag, rtol=1e-6, atol=1e-6)
        assert torch.equal(got[..., rot:], x[..., rot:])
    assert torch.equal(v, parts[:, :, 2])


def assert_views_of(qkv, q, k, v):
    """q, k, v are the three thirds of qkv's last dim, per head, sharing its memory."""
    b, t, width3 = qkv.shape
    thirds = qkv.view(b, t, 3, q.shape[2], q.shape[3])
    for i, part in enumerate((q, k, v)):
        assert part.data_ptr() == thirds[:, :, i].data_ptr() and part.stride() == thirds[:, :, i].stride()
        assert torch.equal(part, thirds[:, :, i])


def test_mismatched_shapes_are_refused():
    qkv, cos, sin = inputs(1, 5, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        split_rope(qkv, cos, sin, heads=5)
    with pytest.raises(ValueError, match="do not fit"):
        split_rope(qkv, cos[:4], sin[:4], heads=2)
    wide = rope_angles(torch.arange(5), 32, 10_000.0)
    with pytest.raises(ValueError, match="exceeds head dim"):
        split_rope(qkv, *wide, heads=2)
    with pytest.raises(ValueError, match="contiguous"):
        split_rope(torch.cat((qkv, qkv), dim=-1)[..., : qkv.shape[-1]], cos, sin, heads=2)


def rounding_bound(qkv, cos, sin, heads, rot):
    """Per rotated element of q and k: the cost of rounding cos/sin, both products and the sum to qkv's dtype,
    half an ulp each, relative to |x| |cos| + |partner| |sin|."""
    b, t, _ = qkv.shape
    parts = qkv.double().abs().view(b, t, 3, heads, -1)
    c, s = cos.double().abs()[:, None], sin.double().abs()[:, None]
    eps = 2.0**-8 if qkv.dtype == torch.bfloat16 else 2.0**-24
    bounds = []
    for x in parts[:, :, 0], parts[:, :, 1]:
        first, second = x[..., : rot // 2], x[..., rot // 2 : rot]
        bounds.append(4 * eps * (x[..., :rot] * c + torch.cat((second, first), dim=-1) * s))
    return bounds


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rounding_bound_holds_for_the_torch_ops_and_catches_a_sign_error(dtype):
    heads, rot = 3, 24
    qkv, cos, sin = inputs(3, 17, heads, 24, rot, dtype)
    exact = split_rope_reference(qkv.double(), cos.double(), sin.double(), heads)
    bounds = rounding_bound(qkv, cos, sin, heads, rot)
    for rotated_by, expected in ((sin, True), (-sin, False)):
        got = split_rope_reference(qkv, cos, rotated_by, heads)
        within = [((g[..., :rot].double() - e[..., :rot]).abs() <= b + 1e-30).all() for g, e, b in zip(got, exact, bounds)]
        assert all(within) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_the_torch_ops_up_to_rounding(shape, dtype):
    """Pass-through dims and v are copied bit for bit; rotated dims of kernel and torch ops both stay within
    the rounding of the dtype of the exact rotation (the H200 showed one-ulp differences in 1.7% of bf16
    elements, largest where the two products cancel); a wrong index or sign is off by O(1)."""
    heads, rot = shape[2], shape[4]
    qkv, cos, sin = inputs(*shape, dtype, device="cuda")
    want = split_rope_reference(qkv, cos, sin, heads)
    exact = split_rope_reference(qkv.double(), cos.double(), sin.double(), heads)
    bounds = rounding_bound(qkv, cos, sin, heads, rot)
    v_before = want[2].clone()
    got = split_rope(qkv, cos, sin, heads)
    assert_views_of(qkv, *got)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g[..., rot:], w[..., rot:])
    assert torch.equal(got[2], v_before)  # v untouched
    for g, w, e, bound in zip(got, want, exact, bounds):
        for result in g, w:
            assert ((result[..., :rot].double() - e[..., :rot]).abs() <= bound + 1e-30).all()
