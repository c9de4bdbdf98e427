"""The DiT's kernels under the interpreter: the residual add + layer norm, the in-place partial RoPE of the fused QKV,
the bidirectional attention and the FP8 policy's casts of activations to e4m3, each on CPU tensors through its op
with the device check lifted."""

from __future__ import annotations

import pytest
import torch

from row_quant_checks import assert_same_rows, rows_to_cast

from music3serve.kernels import add_layer_norm as add_layer_norm_module
from music3serve.kernels import dit_attention as dit_attention_module
from music3serve.kernels import row_quant as row_quant_module
from music3serve.kernels import split_rope as split_rope_module
from music3serve.kernels.add_layer_norm import add_layer_norm, add_layer_norm_fp8, add_layer_norm_reference
from music3serve.kernels.row_quant import fp8_rows
from music3serve.kernels.dit_attention import DEFAULT_CONFIG, dit_attention, dit_attention_reference
from music3serve.kernels.split_rope import split_rope, split_rope_reference
from music3serve.models.fp8 import quantize_rows
from music3serve.models.layers import rope_angles


@pytest.fixture(autouse=True)
def kernels_on_the_cpu(monkeypatch):
    """The ops take their kernels for CPU tensors too (each test's operands meet the other conditions)."""
    for module in (add_layer_norm_module, dit_attention_module, row_quant_module, split_rope_module):
        monkeypatch.setattr(module, "uses_kernel", lambda *operands: True)


def norm_within_a_rounding(h: torch.Tensor, s: torch.Tensor, weight, bias, eps) -> None:
    """h within one bf16 step of the exact norm of the stored sum s (near 0: of 1/16), as tests/test_add_layer_norm.py
    bounds it on the GPU: float32 statistics summed in another order than torch's, one rounding at the end."""
    exact = add_layer_norm_reference(s.double(), None, weight.double(), bias.double(), eps, torch.float64)[1]
    step = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1 / 16)
    assert ((h.double() - exact).abs() <= step).all()


@pytest.mark.parametrize("x_dtype,delta_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, None)])
def test_add_layer_norm_sums_as_torch_and_norms_within_a_rounding(x_dtype, delta_dtype):
    width = 200  # the row's block is 256: a masked tail
    x = (torch.randn(2, 5, width) * 3 + 0.5).to(x_dtype)
    delta = None if delta_dtype is None else torch.randn(2, 5, width).to(delta_dtype)
    weight, bias = torch.randn(width), torch.randn(width)
    s, h = add_layer_norm(x, delta, weight, bias, 1e-6, torch.bfloat16)
    want_s, want_h = add_layer_norm_reference(x, delta, weight, bias, 1e-6, torch.bfloat16)
    assert s.dtype == want_s.dtype and torch.equal(s, want_s) and h.dtype == torch.bfloat16
    norm_within_a_rounding(h, want_s, weight, bias, 1e-6)
    norm_within_a_rounding(want_h, want_s, weight, bias, 1e-6)  # torch's own layer norm meets the bound


@pytest.mark.parametrize("eps", [1e-2, 0.1])
def test_add_layer_norm_adds_eps_to_the_variance(eps):
    """Nearly constant rows (variance ~1e-2), where eps decides the scale."""
    x = torch.randn(2, 5, 128)
    x = x[..., :1] + 0.1 * x
    weight, bias = torch.randn(128), torch.randn(128)
    s, h = add_layer_norm(x, None, weight, bias, eps, torch.bfloat16)
    norm_within_a_rounding(h, x, weight, bias, eps)


ROPE_SHAPES = [  # batch, tokens, heads, head_dim, rotary_dim
    (1, 5, 2, 16, 8),  # the tiny DiT
    (3, 17, 3, 24, 24),  # heads and head_dim not powers of two, the whole head rotated
    (2, 9, 4, 64, 32),  # the full-size DiT's head, fewer heads and tokens
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
def test_split_rope_rotates_in_place_with_the_torch_ops_bits(shape, dtype):
    """The kernel rounds as the torch ops do (cos and sin to the dtype, each product, the sum). The interpreter
    contracts nothing into fused multiply-adds, so here that gives the torch ops' bits; on the H200, where LLVM
    contracts, tests/test_split_rope.py bounds the one-ulp differences instead."""
    batch, tokens, heads, head_dim, rot = shape
    qkv = torch.randn(batch, tokens, 3 * heads * head_dim).to(dtype)
    cos, sin = rope_angles(torch.arange(tokens), rot, 10_000.0)
    want = split_rope_reference(qkv, cos, sin, heads)
    got = split_rope(qkv, cos, sin, heads)
    thirds = qkv.view(batch, tokens, 3, heads, head_dim)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.data_ptr() == thirds[:, :, i].data_ptr()  # views of qkv, rotated there
        assert torch.equal(g, w)


DIT_SHAPES = [  # batch, tokens, heads, head_dim; query and key blocks of 64
    (2, 1, 2, 64),  # a one-column window
    (2, 65, 2, 16),  # a partial last block, the tiny DiT's head_dim
    (1, 130, 1, 128),  # two whole key blocks and a partial one
]


def qkv_views(batch, tokens, heads, head_dim, dtype):
    """q, k, v as split_rope leaves them: strided views of one fused buffer."""
    qkv = torch.randn(batch, tokens, 3 * heads * head_dim).to(dtype)
    return qkv.view(batch, tokens, 3, heads, head_dim).unbind(2)


def exact_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v in float64; [batch, tokens, heads * head_dim]."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    out = (torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v).transpose(1, 2)
    return out.reshape(*out.shape[:2], -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", DIT_SHAPES, ids=str)
def test_dit_attention_is_as_close_to_exact_as_torchs_sdpa(shape, dtype):
    """The bound of tests/test_dit_attention.py: within twice torch's own error (its CPU SDPA here) plus 1e-3 of the
    largest value; a wrong mask or block is off by O(1)."""
    q, k, v = qkv_views(*shape, dtype)
    exact = exact_attention(q, k, v)
    ours = dit_attention(q, k, v, DEFAULT_CONFIG)
    assert ours.shape == exact.shape and ours.dtype == dtype and ours.is_contiguous()
    ours_err = (ours.double() - exact).abs().max().item()
    torch_err = (dit_attention_reference(q, k, v).double() - exact).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-3 * exact.abs().max().item()


def test_dit_attention_of_a_window_is_the_same_alone_and_batched():
    q, k, v = qkv_views(3, 65, 2, 16, torch.bfloat16)
    batched = dit_attention(q, k, v)
    for i in (0, 2):
        assert torch.equal(dit_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1])[0], batched[i])


@pytest.mark.parametrize("width", [200, 2048])
def test_fp8_rows_casts_as_quantize_rows_bit_for_bit(width):
    x = rows_to_cast(5, width, "cpu")
    assert_same_rows(fp8_rows(x), quantize_rows(x))


def test_fp8_rows_of_several_chunks_casts_bit_for_bit():
    x = rows_to_cast(3, 5000, "cpu")
    assert_same_rows(fp8_rows(x), quantize_rows(x))


@pytest.mark.parametrize("delta_dtype", [torch.bfloat16, None])
def test_add_layer_norm_fp8_casts_the_kernels_norm_bit_for_bit(delta_dtype):
    x, delta = (torch.randn(2, 5, 200) * 3).float(), torch.randn(2, 5, 200).to(delta_dtype or torch.float32)
    delta = None if delta_dtype is None else delta
    weight, bias = torch.randn(200), torch.randn(200)
    s, rows = add_layer_norm_fp8(x, delta, weight, bias, 1e-6)
    want_s, h = add_layer_norm(x, delta, weight, bias, 1e-6, torch.bfloat16)
    assert torch.equal(s, want_s)
    assert_same_rows(rows, quantize_rows(h))
