"""The DiT's feed-forward gate: ff_in's rows in (gate, value) pairs give the checkpoint layout's values bit for bit
through the torch ops; on Hopper with quack-kernels, the fused GEMM is within a rounding of float64 and no further
from it than the torch ops, and compiled or graphed callers get its eager bits."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from music3serve.acoustic.precision import BFLOAT16, FLOAT32, apply_dit_policy
from music3serve.kernels import glu_linear as glu_module
from music3serve.kernels.glu_linear import glu, glu_linear, pair_rows, unpair_rows, uses_kernel
from music3serve.models.dit import DiT, DiTConfig

TINY = DiTConfig(channels=8, condition=16, layers=2, heads=2, head_dim=16, ff=48, rotary_dim=8, fourier=16)


def operands(rows: int, width: int, ff: int, device: str, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, width, generator=gen).to(device, dtype)
    weight = (torch.randn(2 * ff, width, generator=gen) * width**-0.5).to(device, dtype)
    bias = (torch.randn(2 * ff, generator=gen) * 0.1).to(device, dtype)
    return h, weight, bias


def checkpoint_glu(h, weight, bias):
    value, gate = F.linear(h, weight, bias).chunk(2, dim=-1)
    return value * F.silu(gate)


def test_pair_rows_interleaves_gate_then_value():
    rows = torch.arange(8)  # value rows 0..3, gate rows 4..7
    assert pair_rows(rows).tolist() == [4, 0, 5, 1, 6, 2, 7, 3]
    assert pair_rows(torch.arange(12).view(6, 2))[:2].tolist() == [[6, 7], [0, 1]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pairs_give_the_checkpoint_layouts_values_on_the_cpu(dtype):
    h, weight, bias = operands(37, 64, 96, "cpu", dtype)
    want = checkpoint_glu(h, weight, bias)
    assert torch.equal(unpair_rows(pair_rows(weight)), weight)
    # The same dot products in other output columns: bit for bit here in bf16; a CPU GEMM may block the columns
    # otherwise (float32 here: last-bit differences), so a rounding of the dtype is allowed.
    torch.testing.assert_close(glu_linear(h, pair_rows(weight), pair_rows(bias)), want)
    assert not uses_kernel(10**6, pair_rows(weight), pair_rows(bias))  # no fused GEMM off CUDA


def tiny_dit() -> DiT:
    torch.manual_seed(0)
    dit = DiT(TINY).eval()
    dit.fourier.data.normal_()  # torch.empty until a checkpoint fills it
    return dit


def test_the_bf16_policy_pairs_the_rows_once_and_the_dit_computes_the_same():
    paired, plain = tiny_dit(), DiT(TINY).eval()
    plain.load_state_dict(paired.state_dict())
    checkpoint_ff_in = paired.blocks[0].ff_in.weight.detach().clone()
    apply_dit_policy(plain, FLOAT32)
    assert not any(block.glu_pairs for block in plain.blocks)  # the float32 reference keeps the checkpoint order
    for _ in range(2):  # applying the policy again leaves the pairs as they are
        apply_dit_policy(paired, BFLOAT16)
        assert all(block.glu_pairs for block in paired.blocks)
        assert torch.equal(paired.blocks[0].ff_in.weight, pair_rows(checkpoint_ff_in).bfloat16())
    apply_dit_policy(plain, BFLOAT16)
    for block in plain.blocks:  # the same bf16 model back in the checkpoint's order
        block.set_glu_pairs(False)
    assert torch.equal(plain.blocks[0].ff_in.weight, checkpoint_ff_in.bfloat16())
    latents, t, cond = torch.randn(2, 8, 5), torch.rand(2), torch.randn(2, 5, 16)
    with torch.inference_mode():
        want, got = plain(latents, t, cond), paired(latents, t, cond)
    # Bit for bit here; another CPU's GEMM may round a column differently (see above). Swapping gate and value
    # would be off by ~1.
    assert ((got - want).norm() / want.norm()).item() <= 1e-2


def test_state_dicts_hold_the_checkpoint_order_whatever_the_layout():
    dit = tiny_dit()
    checkpoint = {k: v.clone() for k, v in dit.state_dict().items()}
    apply_dit_policy(dit, BFLOAT16)
    assert dit.blocks[0].glu_pairs
    saved = dit.state_dict()
    assert torch.equal(saved["blocks.0.ff_in.weight"], checkpoint["blocks.0.ff_in.weight"].bfloat16())
    assert torch.equal(saved["blocks.1.ff_in.bias"], checkpoint["blocks.1.ff_in.bias"].bfloat16())
    latents, t, cond = torch.randn(2, 8, 5), torch.rand(2), torch.randn(2, 5, 16)
    with torch.inference_mode():
        want = dit(latents, t, cond)
        dit.load_state_dict(saved)  # into the paired model: the rows are paired as they load
        assert torch.equal(dit(latents, t, cond), want)
        fresh = DiT(TINY).eval()
        fresh.load_state_dict(saved)  # into a model in the checkpoint order, then the policy
        apply_dit_policy(fresh, BFLOAT16)
        assert torch.equal(fresh(latents, t, cond), want)
    apply_dit_policy(dit, FLOAT32)  # back to the reference: the checkpoint's order in memory too
    assert not dit.blocks[0].glu_pairs
    assert torch.equal(dit.blocks[0].ff_in.weight, checkpoint["blocks.0.ff_in.weight"].bfloat16().float())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2048, 2049, 11048])
def test_fused_gemm_is_as_close_to_exact_as_the_torch_ops(rows):
    h, weight, bias = operands(rows, 2048, 8192, "cuda")
    weight, bias = pair_rows(weight), pair_rows(bias)
    if not uses_kernel(rows, weight, bias):
        pytest.skip("needs quack-kernels on a Hopper GPU")
    exact = glu(F.linear(h.double(), weight.double(), bias.double()), pairs=True)
    fused, ops = glu_linear(h, weight, bias), glu(F.linear(h, weight, bias), pairs=True)
    assert glu_module._failure is None and not torch.equal(fused, ops)  # the fused GEMM ran: its own roundings
    assert fused.shape == ops.shape == (rows, 8192) and fused.dtype == torch.bfloat16
    err = lambda out: ((out.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    # One rounding of the float32 result (2^-9 relative at most, ~2^-10 on average) against the torch ops' three.
    assert err(fused) <= min(err(ops), 3e-3), (err(fused), err(ops))


@pytest.mark.gpu
def test_fused_gemm_in_compiled_and_graphed_callers_gives_the_eager_bits(monkeypatch):
    monkeypatch.setattr(glu_module, "MIN_ROWS", 1)
    h, weight, bias = operands(300, 256, 512, "cuda")
    weight, bias = pair_rows(weight), pair_rows(bias)
    if not uses_kernel(300, weight, bias):
        pytest.skip("needs quack-kernels on a Hopper GPU")

    def feed_forward(h):
        return glu_linear(h, weight, bias) * 2

    eager = feed_forward(h)
    assert glu_module._failure is None
    assert torch.equal(torch.compile(feed_forward, fullgraph=True, dynamic=True)(h), eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = feed_forward(h)
    h.mul_(-1)
    graph.replay()
    assert torch.equal(out, feed_forward(h))


def test_the_kernel_takes_enough_aligned_rows_only(monkeypatch):
    monkeypatch.setattr(glu_module, "unavailable_reason", lambda weight: None)  # a Hopper GPU with quack, as it were
    _, weight, bias = operands(1, 64, 96, "cpu")
    weight, bias = pair_rows(weight), pair_rows(bias)
    assert uses_kernel(glu_module.MIN_ROWS, weight, bias) and uses_kernel(glu_module.MIN_ROWS, weight, None)
    assert not uses_kernel(glu_module.MIN_ROWS - 1, weight, bias)  # few rows: cuBLAS and the gate pass
    assert not uses_kernel(10**6, weight[:, :60], bias)  # input rows of 120 bytes: not 16-byte aligned
    assert not uses_kernel(10**6, weight[:184], bias[:184])  # output rows of 184 bytes
    assert not uses_kernel(10**6, weight, bias.float())
    assert not uses_kernel(10**6, weight, bias[:-16])


def test_the_kernel_is_not_taken_off_hopper_or_below_bf16():
    _, weight, bias = operands(1, 64, 96, "cpu")
    assert glu_module.unavailable_reason(weight) == "not a Hopper GPU"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        assert glu_module.unavailable_reason(weight.float().cuda()) == "torch.float32 weights, not bf16"


def test_a_missing_quack_is_named_with_the_extra_to_install(monkeypatch):
    real_import = glu_module.importlib.import_module

    def without_quack(name, *args):
        if name.split(".")[0] == "quack":
            raise ModuleNotFoundError(f"No module named {name!r}", name="quack")
        return real_import(name, *args)

    glu_module.quack_import_error.cache_clear()
    monkeypatch.setattr(glu_module.importlib, "import_module", without_quack)
    try:
        assert "pip install -e '.[hopper]'" in glu_module.quack_import_error()
    finally:
        glu_module.quack_import_error.cache_clear()


@pytest.mark.parametrize("reason, level", [(None, "INFO"), ("quack-kernels is not installed", "WARNING"),
                                           ("not a Hopper GPU", None)])
def test_the_renderer_says_how_the_gate_runs(monkeypatch, caplog, reason, level):
    from music3serve.acoustic.renderer import log_feed_forward_gate

    monkeypatch.setattr(glu_module, "unavailable_reason", lambda weight: reason)
    with caplog.at_level("INFO", logger="music3serve.acoustic.renderer"):
        log_feed_forward_gate(torch.zeros(2, 2))
    assert [r.levelname for r in caplog.records] == ([level] if level else [])
    if level == "WARNING":
        assert caplog.records[0].reason == reason


def test_a_failing_quack_gemm_falls_back_once_and_for_good(monkeypatch, caplog):
    """The fused GEMM compiles on first use: if that fails, the call still returns the gate (the torch ops), says so,
    and no later call tries quack again."""
    calls = []

    def gemm_act(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("no ptxas here")

    interface = types.ModuleType("quack.gemm_interface")
    interface.gemm_act = gemm_act
    config = types.ModuleType("quack.gemm_config")
    config.GemmConfig = lambda **kwargs: kwargs
    for name, module in (("quack", types.ModuleType("quack")), ("quack.gemm_interface", interface),
                         ("quack.gemm_config", config)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(glu_module, "_failure", None)
    monkeypatch.setattr(glu_module, "MIN_ROWS", 1)
    # A Hopper GPU with quack importable, as far as glu_linear can tell, until quack fails:
    monkeypatch.setattr(glu_module, "unavailable_reason", lambda weight: glu_module._failure)
    h, weight, bias = operands(37, 64, 96, "cpu")
    weight, bias = pair_rows(weight), pair_rows(bias)
    want = glu(F.linear(h, weight, bias), pairs=True)
    with caplog.at_level("WARNING", logger="music3serve.kernels.glu_linear"):
        assert torch.equal(glu_linear(h, weight, bias), want)
        assert torch.equal(glu_linear(h, weight, bias), want)
    assert len(calls) == 1 and not uses_kernel(37, weight, bias)
    assert [r.reason for r in caplog.records] == ["quack's GEMM failed: RuntimeError: no ptxas here"]
