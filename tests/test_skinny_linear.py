"""The skinny decode kernels (GPU): x @ w.T within one bf16 rounding of the exact product, SwiGLU's gated half
within the roundings the torch ops make, a row's bits independent of the rows beside it, and graph replay and
compiled callers giving the eager bits; elsewhere they are the torch ops exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from music3serve.kernels.skinny_linear import (
    MAX_ROWS,
    gated_silu_reference,
    skinny_gated_silu,
    skinny_linear,
    uses_kernel,
)
from music3serve.kernels.pdl import uses_pdl
from music3serve.models.layers import linear, swiglu

SHAPES = [  # N, K
    (6144, 4096),  # the backbone's qkv
    (16385, 4096),  # the legal-column head: N not a multiple of any tile
    (1024, 4096),  # a depth-decoder head
    (96, 200),  # the tiny checkpoint's scale, K not a multiple of the K tile
]
GATED_SHAPES = [(24576, 4096), (12288, 4096), (96, 200)]  # gate_up weights: backbone, depth decoder, tiny
OPS = {"linear": skinny_linear, "gated": skinny_gated_silu}


def operands(rows: int, n: int, k: int, device: str, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(n + k + rows)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_the_cpu_they_are_the_torch_ops_the_models_used_before(dtype):
    """models/layers.py `linear` and `swiglu`, with and without the residual, give the bits of the formulas the
    models wrote before the kernels existed (x + F.linear(...), F.linear(F.silu(gate) * up, down))."""
    x, w = operands(5, 96, 200, "cpu", dtype)
    residual, down = operands(5, 200, 96, "cpu", dtype)[0], operands(1, 48, 48, "cpu", dtype)[1]
    x_mlp = operands(5, 200, 48, "cpu", dtype)[0][:, :48].contiguous()
    assert not uses_kernel(x, w)
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert torch.equal(linear(x, w, residual), residual + F.linear(x, w))
    gate_up = operands(1, 96, 48, "cpu", dtype)[1]
    gate, up = F.linear(x_mlp, gate_up).chunk(2, dim=-1)
    assert torch.equal(swiglu(x_mlp, gate_up, down), F.linear(F.silu(gate) * up, down))
    mlp_residual = x_mlp * 3
    assert torch.equal(swiglu(x_mlp, gate_up, down, mlp_residual), mlp_residual + F.linear(F.silu(gate) * up, down))


def test_a_residual_of_another_shape_or_dtype_is_an_error():
    x, w = operands(5, 96, 200, "cpu")
    with pytest.raises(ValueError, match="residual"):
        skinny_linear(x, w, torch.zeros(5, 95, dtype=x.dtype))
    with pytest.raises(ValueError, match="residual"):
        skinny_linear(x, w, torch.zeros(5, 96))


@pytest.mark.parametrize("case", ["linear", "linear + residual", "gated"])
def test_the_ops_pass_torch_library_opcheck(case):
    """Fake implementations agree with the real ones (shapes, dtypes, strides) and the ops trace under compile."""
    x, w = operands(3, 96, 200, "cpu")
    x = x.view(3, 1, 200)
    if case == "gated":
        torch.library.opcheck(skinny_gated_silu, (x, w))
    else:
        residual = operands(3, 8, 96, "cpu")[0].view(3, 1, 96) if case.endswith("residual") else None
        torch.library.opcheck(skinny_linear, (x, w, residual))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_linear_is_the_product_within_one_bf16_rounding(shape, rows):
    n, k = shape
    x, w = operands(rows, n, k, "cuda")
    assert uses_kernel(x, w)
    got = skinny_linear(x, w).double()
    exact = x.double() @ w.double().T
    # float32 accumulation of k products, then one rounding to bf16 (2^-8 relative).
    bound = exact.abs() * 2.0**-8 + (x.double().abs() @ w.double().abs().T) * k * 2.0**-24
    assert ((got - exact).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_residual_is_added_to_the_rounded_product_as_the_torch_add_does(shape):
    n, k = shape
    x, w = operands(3, n, k, "cuda")
    residual = operands(3, 8, n, "cuda")[0] * 4
    assert torch.equal(skinny_linear(x.view(3, 1, k), w, residual.view(3, 1, n)), (residual + skinny_linear(x, w)).view(3, 1, n))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_residual_row_broadcast_to_every_row_is_added_as_the_torch_add_does(shape):
    n, k = shape
    x, w = operands(3, n, k, "cuda")
    row = operands(1, 8, n, "cuda")[0][0] * 4
    assert row.expand(3, n).stride(0) == 0
    assert torch.equal(skinny_linear(x, w, row.expand(3, n)), row + skinny_linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rows_sliced_from_a_longer_sequence_give_the_bits_of_their_copy(shape):
    n, k = shape
    x, w = operands(6, n, k, "cuda")
    last = x.view(3, 2, k)[:, -1]
    assert not last.is_contiguous()
    assert torch.equal(skinny_linear(last, w), skinny_linear(last.contiguous(), w))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GATED_SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 2, 16])
def test_gated_silu_is_within_the_roundings_of_the_torch_ops(shape, rows):
    n, k = shape
    x, w = operands(rows, n, k, "cuda")
    got = skinny_gated_silu(x, w).double()
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    act = F.silu(gate)
    # float32 accumulation of gate and up (k products each), then four bf16 roundings (gate, up, silu, product),
    # each 2^-8 relative; silu' <= 1.1 carries an error of gate into silu.
    acc_gate, acc_up = ((x.double().abs() @ w.double().abs().T) * k * 2.0**-24).chunk(2, dim=-1)
    ulp = 2.0**-8
    gate_err, up_err = ulp * gate.abs() + acc_gate, ulp * up.abs() + acc_up
    bound = ulp * 2 * (act * up).abs() + 1.1 * gate_err * up.abs() + act.abs() * up_err + gate_err * up_err
    assert ((got - act * up).abs() <= bound).all()
    ref = gated_silu_reference(x, w).double()
    assert ((ref - act * up).abs() <= bound).all()  # the torch ops meet the same bound


@pytest.mark.gpu
@pytest.mark.parametrize(("op", "shape"), [("linear", SHAPES[1]), ("linear", SHAPES[3])] + [("gated", s) for s in GATED_SHAPES])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(op, shape):
    fn = OPS[op]
    x, w = operands(MAX_ROWS, *shape, "cuda")
    full = fn(x, w)
    for rows in (1, 2, 7, 16, 17, 33, 100):  # one row tile, several, the last one partial
        assert torch.equal(fn(x[:rows].clone(), w), full[:rows])
    assert torch.equal(fn(x.flip(0).contiguous(), w), full.flip(0))


@pytest.mark.gpu
def test_one_binary_serves_every_row_count():
    """Triton compiles a kernel again for each way its integer arguments divide by 16. The row count is not
    specialised: 2 to 16 rows (one to eight songs) run one binary, compiled once per tile in warm-up."""
    from music3serve.kernels.skinny_linear_kernel import _kernel, run_kernel

    def binaries() -> int:
        return sum(len(caches[0]) for caches in _kernel().device_caches.values())

    x, w = operands(MAX_ROWS, 1024, 4096, "cuda")
    before = binaries()
    for rows in (2, 5, 8, 16):
        run_kernel(x[:rows], w, (16, 64, 2, 2))  # a tile no other call takes
    assert binaries() == before + 1


@pytest.mark.gpu
def test_graph_replay_and_compiled_callers_give_the_eager_bits():
    x, w = operands(4, 6144, 4096, "cuda")
    gate_up, down = operands(1, 4096, 6144, "cuda")[1], operands(1, 4096, 2048, "cuda")[1]
    block = lambda a: swiglu(linear(a, w), gate_up, down)  # noqa: E731 (a projection, then a gated MLP)
    eager = block(x.view(4, 1, -1))
    static = x.clone().view(4, 1, -1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        block(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(static)
    static.zero_()
    graph.replay()
    assert not torch.equal(out, eager)
    static.copy_(x.view(4, 1, -1))
    graph.replay()
    assert torch.equal(out, eager)
    compiled = torch.compile(lambda a: block(a) + 1, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(x.view(4, 1, -1)), eager + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_more_rows_than_the_kernels_take_go_to_the_torch_ops(op):
    x, w = operands(MAX_ROWS + 1, 1024, 4096, "cuda")
    assert not uses_kernel(x, w)
    reference = F.linear if op == "linear" else gated_silu_reference
    assert torch.equal(OPS[op](x, w), reference(x, w))


@pytest.mark.gpu
def test_a_chain_launched_with_pdl_gives_the_bits_of_plain_launches(monkeypatch):
    """Under programmatic dependent launch (kernels/pdl.py) each kernel may start before the one it reads from has
    finished; it must still wait for it. A chain of dependent kernels in a captured graph, replayed after its input
    changed, gives the bits of the same chain launched plainly."""
    x, w = operands(2, 4096, 4096, "cuda")
    gate_up, down = operands(1, 12288, 4096, "cuda")[1], operands(1, 4096, 6144, "cuda")[1]

    def chain(a):  # each link reads the one before it; the norm keeps the values finite for the bit comparison
        for _ in range(8):
            a = swiglu(linear(a, w, a), gate_up, down, a)
            a = a / a.float().norm(dim=-1, keepdim=True).to(a.dtype) * 64
        return a

    monkeypatch.setenv("MUSIC3SERVE_PDL", "off")
    plain = chain(x)
    monkeypatch.setenv("MUSIC3SERVE_PDL", "all")
    if not uses_pdl(x.device):
        pytest.skip("needs programmatic dependent launch (CUDA capability 9.0+, Triton 3.4+)")
    static = torch.zeros_like(x)
    chain(static)  # compile the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static)
    static.copy_(x)
    graph.replay()
    assert plain.isfinite().all()
    assert torch.equal(out, plain)
    assert torch.equal(chain(x), plain)  # eager PDL launches too


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_a_pdl_launch_waits_for_a_producer_that_lets_it_start_early(op, late_copy):
    """The producer lets the kernel start at once and writes x only 100 us later: read before gdc_wait, x would
    still be zeros."""
    x, w = operands(2, 4096, 4096, "cuda")
    w = w if op == "linear" else torch.cat((w, w.flip(0)))
    expected = OPS[op](x, w)
    assert torch.equal(OPS[op](late_copy(x), w), expected)
