"""The DiT's residual add + layer norm kernel: the sum exactly as torch adds, the norm within one rounding of
torch's layer norm in the output dtype; the torch ops themselves on the CPU and for the float32 policy."""

from __future__ import annotations

import pytest
import torch

from music3serve.kernels.add_layer_norm import add_layer_norm, add_layer_norm_reference


def operands(width: int, x_dtype, delta_dtype, device: str, rows: int = 7):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(2, rows, width, generator=gen) * 3 + 0.5).to(device, x_dtype)
    delta = None if delta_dtype is None else torch.randn(2, rows, width, generator=gen).to(device, delta_dtype)
    weight, bias = torch.randn(width, generator=gen).to(device), torch.randn(width, generator=gen).to(device)
    return x, delta, weight, bias


@pytest.mark.parametrize("delta_dtype", [torch.bfloat16, None])
def test_cpu_is_the_torch_ops_and_returns_new_tensors(delta_dtype):
    x, delta, weight, bias = operands(64, torch.float32, delta_dtype, "cpu")
    s, h = add_layer_norm(x, delta, weight, bias, 1e-6, torch.bfloat16)
    rs, rh = add_layer_norm_reference(x, delta, weight, bias, 1e-6, torch.bfloat16)
    assert torch.equal(s, rs) and torch.equal(h, rh) and h.dtype == torch.bfloat16
    assert s.data_ptr() != x.data_ptr()  # a custom op's outputs never alias its inputs


@pytest.mark.gpu
@pytest.mark.parametrize("width", [2048, 4096, 200])
@pytest.mark.parametrize("x_dtype,delta_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, None)])
def test_kernel_sum_is_exact_and_norm_within_a_rounding(width, x_dtype, delta_dtype):
    x, delta, weight, bias = operands(width, x_dtype, delta_dtype, "cuda", rows=300)
    s, h = add_layer_norm(x, delta, weight, bias, 1e-6, torch.bfloat16)
    rs, rh = add_layer_norm_reference(x, delta, weight, bias, 1e-6, torch.bfloat16)
    assert s.dtype == rs.dtype and torch.equal(s, rs)
    # The exact norm of the rounded sum (both torch and the kernel normalize s as stored).
    exact = add_layer_norm_reference(rs.double(), None, weight.double(), bias.double(), 1e-6, torch.float64)[1]
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1 / 16)  # one bf16 ulp; near 0, of 1/16
    assert ((h.double() - exact).abs() <= ulp).all()  # within a rounding of the exact norm, as torch's is
    assert ((rh.double() - exact).abs() <= ulp).all()  # the bound holds for torch's own layer norm too


@pytest.mark.gpu
@pytest.mark.parametrize("eps", [1e-2, 0.1])
def test_kernel_adds_eps_to_the_variance(eps):
    """Rows of nearly constant values, where eps decides the scale."""
    x, _, weight, bias = operands(2048, torch.float32, None, "cuda", rows=50)
    x = x[..., :1] + 0.03 * x  # variance ~1e-2: comparable to both eps values
    s, h = add_layer_norm(x, None, weight, bias, eps, torch.bfloat16)
    exact = add_layer_norm_reference(x.double(), None, weight.double(), bias.double(), eps, torch.float64)[1]
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1 / 16)
    assert ((h.double() - exact).abs() <= ulp).all()


@pytest.mark.gpu
def test_the_float32_policy_keeps_torchs_layer_norm():
    x, delta, weight, bias = operands(2048, torch.float32, torch.float32, "cuda")
    s, h = add_layer_norm(x, delta, weight, bias, 1e-6, torch.float32)
    rs, rh = add_layer_norm_reference(x, delta, weight, bias, 1e-6, torch.float32)
    assert torch.equal(s, rs) and torch.equal(h, rh)


@pytest.mark.gpu
def test_compiled_and_graphed_callers_get_the_eager_bits():
    x, delta, weight, bias = operands(2048, torch.float32, torch.bfloat16, "cuda")

    def block_input(x, delta):
        s, h = add_layer_norm(x, delta, weight, bias, 1e-6, torch.bfloat16)
        return s * 2, h

    eager = block_input(x, delta)
    compiled = torch.compile(block_input, fullgraph=True, dynamic=True)(x, delta)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block_input(x, delta)
    x.mul_(-1)
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(out, block_input(x, delta)))
