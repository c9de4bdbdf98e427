"""bf16x3_linear (acoustic/precision.py): the float32 islands' Linear layers as three bf16 products summed in float32.

The bound, per output element y = sum_k x_k w_k (+ b), for float32 x, w:
- split: x = x_hi + x_lo + e_x with |x - x_hi| <= 2^-8 |x| (bf16 keeps 8 significant bits, round to nearest),
  x - x_hi exact in float32 (Sterbenz), |e_x| <= 2^-8 |x - x_hi| <= 2^-16 |x|, |x_lo| <= 2^-8 (1 + 2^-8) |x|;
  the same for w. The three kept products leave out x_hi e_w + x_lo w_lo + x_lo e_w + e_x w, at most
  2^-16 (3 + 2^-5) |x| |w| per term.
- sum: a product of two bf16 values (8 + 8 bits) is exact in float32, so only the float32 sum of the 3 K products
  and the bias rounds: at most gamma(3 K + 1) (sum of |products| + |b|), gamma(n) = n u / (1 - n u), with
  sum |products| <= (1 + 2^-5) sum |x| |w|. u is 2^-24 for round-to-nearest sums (the CPU); tensor cores are taken
  to truncate (Fasi et al., "Numerical behavior of NVIDIA tensor cores", 2021), u = 2^-23.
So |y_bf16x3 - y| <= (2^-16 (3 + 2^-5) + (1 + 2^-5) gamma(3 K + 1)) (|x| |W|^T + |b|): 5.8e-5 relative to that
magnitude at K = 64 on the CPU, which bf16 (2^-7 per product) and TF32 inputs (2^-10) do not stay under.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from music3serve.acoustic.precision import Bf16x3Linear, bf16_split, bf16x3_linear, split_weight

CPU_SUM_U = 2.0**-24  # float32 round to nearest
TENSOR_CORE_SUM_U = 2.0**-23  # float32 accumulation taken to truncate


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def bf16x3_relative_bound(k: int, sum_u: float) -> float:
    """The bound derived in the module docstring, relative to |x| |W|^T + |b|."""
    return 2.0**-16 * (3 + 2.0**-5) + (1 + 2.0**-5) * gamma(3 * k + 1, sum_u)


def magnitude(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """|x| |W|^T + |b| in float64."""
    return x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())


def bf16x3_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sum_u: float) -> torch.Tensor:
    """Per output element, the bound on |bf16x3 - exact|."""
    return bf16x3_relative_bound(x.shape[-1], sum_u) * magnitude(x, weight, bias)


def float32_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The same for a float32 linear: the products round too, gamma(K + 1) with u = 2^-24."""
    return gamma(x.shape[-1] + 1, 2.0**-24) * magnitude(x, weight, bias)


def round_mantissa(t: torch.Tensor, bits: int) -> torch.Tensor:
    """t rounded to `bits` bits after the leading one, to nearest (TF32: 10, bf16: 7), in float64."""
    mantissa, exponent = torch.frexp(t.double())  # mantissa in [0.5, 1)
    return torch.ldexp(torch.round(mantissa * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), exponent)


def operands(rows: int, k: int, n: int, bias: bool, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, k)  # columns over four decades
    weight = torch.randn(n, k, generator=gen) * k**-0.5
    b = torch.randn(n, generator=gen) if bias else None
    return x.to(device), weight.to(device), None if b is None else b.to(device)


def exact(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def normwise(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float((reference - other.double()).norm() / reference.norm())


def test_split_keeps_16_bits():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * torch.logspace(-30, 30, 4096)
    hi, lo = bf16_split(x)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(hi, x.bfloat16())
    rest = x.double() - hi.double() - lo.double()
    assert (rest.abs() <= 2.0**-16 * x.double().abs()).all()
    assert (lo.double().abs() <= 2.0**-8 * (1 + 2.0**-8) * x.double().abs()).all()
    assert rest.abs().max() > 0  # 16 bits, not 24: a float32 pair would leave nothing


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("shape", [(33, 64, 48), (7, 300, 20)], ids=str)
def test_bf16x3_stays_within_the_derived_bound_of_the_exact_and_the_float32_product(shape, bias):
    x, weight, b = operands(*shape, bias)
    got = bf16x3_linear(x, split_weight(weight), b)
    assert got.dtype == torch.float32 and got.shape == (shape[0], shape[2])
    want = exact(x, weight, b)
    bound = bf16x3_bound(x, weight, b, CPU_SUM_U)
    assert ((got.double() - want).abs() <= bound).all()
    ieee = F.linear(x, weight, b)
    assert ((got.double() - ieee.double()).abs() <= bound + float32_bound(x, weight, b)).all()


def test_bf16_and_tf32_inputs_break_the_bound_that_bf16x3_keeps():
    x, weight, b = operands(33, 64, 48, bias=True)
    want, bound = exact(x, weight, b), bf16x3_bound(x, weight, b, CPU_SUM_U)
    errors = {
        "bf16x3": bf16x3_linear(x, split_weight(weight), b).double() - want,
        "bf16": F.linear(x.bfloat16(), weight.bfloat16(), b.bfloat16()).double() - want,
        "tf32": F.linear(round_mantissa(x, 10), round_mantissa(weight, 10), b.double()) - want,
        "one term left out": bf16x3_linear(x, split_weight(weight).index_fill(1, torch.arange(64, 128), 0), b) - want,
    }
    within = {name: bool((e.abs() <= bound).all()) for name, e in errors.items()}
    assert within == {"bf16x3": True, "bf16": False, "tf32": False, "one term left out": False}
    rel = {name: float(e.norm() / want.norm()) for name, e in errors.items()}
    assert rel["bf16x3"] < 1e-5 and rel["bf16x3"] * 20 < rel["tf32"] and rel["bf16x3"] * 500 < rel["bf16"], rel


def test_layer_shares_the_float32_parameters_and_compiles_whole():
    linear = torch.nn.Linear(64, 48)
    layer = Bf16x3Linear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias and set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 6, 64)
    plain = layer(x[:, 1:])  # a strided slice, as the head reads the residual stream
    assert plain.shape == (2, 5, 48)
    assert torch.equal(plain, bf16x3_linear(x[:, 1:].reshape(10, 64), layer.split, layer.bias).view(2, 5, 48))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)  # as inductor would see it
    assert torch.equal(compiled(x[:, 1:]), plain)
    assert compiled(torch.randn(3, 64)).shape == (3, 48)


def test_the_split_follows_loaded_weights_and_stays_bf16_when_the_layer_moves():
    layer = Bf16x3Linear(torch.nn.Linear(64, 48))
    x = operands(5, 64, 48, bias=False)[0]
    layer.load_state_dict({name: value * 2 for name, value in layer.state_dict().items()})
    want = exact(x, layer.weight.detach(), layer.bias.detach())
    bound = bf16x3_bound(x, layer.weight.detach(), layer.bias.detach(), CPU_SUM_U)
    assert ((layer(x).detach().double() - want).abs() <= bound).all()
    layer.double()
    assert layer.split.dtype == torch.bfloat16 and layer.weight.dtype == torch.float64
    assert torch.equal(layer.split, split_weight(layer.weight))


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("shape", [(33, 64, 48), (16 * 689, 2304, 2304), (16 * 688, 2048, 128)], ids=str)
def test_cuda_bf16x3_stays_within_the_derived_bound(shape, bias):
    x, weight, b = operands(*shape, bias, device="cuda")
    split = split_weight(weight)
    want = exact(x, weight, b)
    bound = bf16x3_bound(x, weight, b, TENSOR_CORE_SUM_U)
    tf32 = F.linear(round_mantissa(x, 10), round_mantissa(weight, 10), None if b is None else b.double())
    tf32 = normwise(want, tf32)

    def check(y: torch.Tensor) -> None:  # the bound is loose at large K: TF32's error catches a lost x_lo there
        assert y.dtype == torch.float32 and ((y.double() - want).abs() <= bound).all()
        assert normwise(want, y) * 20 < tf32, (normwise(want, y), tf32)

    eager = bf16x3_linear(x, split, b)
    check(eager)
    graph = torch.cuda.CUDAGraph()  # captured: no host syncs, no new weights
    with torch.cuda.graph(graph):
        captured = bf16x3_linear(x, split, b)
    graph.replay()
    assert torch.equal(captured, eager)
    # Inductor keeps the bf16 rounding of x_hi only with emulate_precision_casts (enable_fusion sets it).
    with torch._inductor.config.patch(emulate_precision_casts=True):
        check(torch.compile(bf16x3_linear, fullgraph=True, dynamic=True)(x, split, b))
