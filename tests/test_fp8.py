"""FP8 (quantization: fp8) on the CPU: the quantization math, the emulation of the FP8 kernels' arithmetic, its error
on the tiny checkpoint under thresholds measured there, the default engine untouched, and the settings."""

from __future__ import annotations

import copy
import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from music3serve.acoustic.precision import BFLOAT16, FP8, PrecisionPolicy, apply_dit_policy
from music3serve.bench.fp8 import talker_agreement
from music3serve.bench.precision import measure_precision, rel_err
from music3serve.checkpoint import load_component, load_models
from music3serve.cli import build_parser
from music3serve.errors import Music3Error
from row_quant_checks import assert_same_rows, rows_to_cast

from music3serve.kernels.add_layer_norm import add_layer_norm_fp8, add_layer_norm_reference
from music3serve.kernels.glu_linear import pair_rows
from music3serve.kernels.row_quant import fp8_rows
from music3serve.models.fp8 import (
    E4M3, Fp8Linear, dequantize, quantize, quantize_linears, quantize_rows, scaled_linear, scaled_reference,
    weight_only_reference,
)
from music3serve.models.layers import linear, swiglu
from music3serve.pipeline import Pipeline
from music3serve.serving.deploy_config import ConfigError, load_deploy_config, with_quantization
from music3serve.serving.deploy_schema import precision_log_level
from music3serve.talker.quantize import quantize_talker


def test_weights_are_e4m3_codes_with_one_scale_per_output_channel():
    w = torch.randn(3, 5, 64) * torch.logspace(-3, 2, 5)[None, :, None]
    w[0, 1] = 0  # an all-zero row keeps a finite scale
    q = quantize(w)
    assert q.codes.dtype == E4M3 and q.codes.shape == w.shape and q.scale.shape == (3, 5)
    assert torch.isfinite(q.scale).all() and (dequantize(q, torch.float32)[0, 1] == 0).all()
    assert torch.equal(q.scale[1], w[1].abs().amax(-1) * torch.tensor(1 / 448))  # float32(1/448), on every device
    assert torch.equal(q.codes.float().abs().amax(-1)[1], torch.full((5,), 448.0))  # every row's largest is e4m3's
    # 3 mantissa bits: a normal value rounds within 2^-4 of itself
    normal = w.abs() >= 2**-6 * q.scale[..., None] * 448 / 2**8
    err = (dequantize(q, torch.float32) - w).abs()
    assert (err[normal] <= 2**-4 * w.abs()[normal] * (1 + 1e-6)).all()


def test_weight_only_product_is_x_times_the_dequantized_weight():
    q = quantize(torch.randn(48, 96))
    x = torch.randn(2, 7, 96)
    want = F.linear(x.double(), dequantize(q, torch.float64))
    got = weight_only_reference(x, q)
    assert got.shape == (2, 7, 48) and got.dtype == x.dtype
    assert rel_err(want, got) < 1e-6
    assert torch.equal(linear(x, q), got)  # the models' linear dispatches on an FP8 weight
    gate_up, down = quantize(torch.randn(64, 96)), quantize(torch.randn(96, 32))
    value = weight_only_reference(x, gate_up).chunk(2, dim=-1)
    assert torch.equal(swiglu(x, gate_up, down), weight_only_reference(F.silu(value[0]) * value[1], down))


def test_scaled_product_quantizes_each_activation_row_to_e4m3():
    q = quantize(torch.randn(32, 64))
    x = torch.randn(5, 64, dtype=torch.bfloat16) * torch.logspace(-2, 2, 5)[:, None]
    bias = torch.randn(32)
    x_q = quantize(x.float())  # the same per-row rule as the weights
    want = F.linear(dequantize(x_q, torch.float64), dequantize(q, torch.float64), bias.double())
    got = scaled_linear(x, q, bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, scaled_reference(x, q, bias))
    assert rel_err(want, got) < 2**-8  # the bf16 rounding of the output alone
    exact = F.linear(x.double(), q.codes.double() * q.scale.double()[:, None], bias.double())
    assert 2**-8 < rel_err(exact, got) < 2**-4  # and e4m3 activations cost more than that


def test_quantize_linears_swaps_the_named_linears_once():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    assert quantize_linears(model, lambda name: name == "0") == ["0"]
    assert isinstance(model[0], Fp8Linear) and type(model[2]) is nn.Linear
    assert quantize_linears(model) == ["2"] and quantize_linears(model) == []  # Fp8Linear layers stay as they are
    layer = model[0]
    assert {n for n, _ in layer.named_buffers()} == {"codes", "scale"} and layer.bias is not None
    x = torch.randn(4, 16)
    assert torch.equal(layer(x), scaled_linear(x, layer.weight, layer.bias))


def test_the_fp8_policy_quantizes_the_dit_blocks_after_pairing_their_rows(tiny_dir):
    dit = load_component(tiny_dir, "dit", "cpu", torch.float32)
    original = copy.deepcopy(dit)
    apply_dit_policy(dit, FP8)
    assert PrecisionPolicy.named("fp8") is FP8 and FP8.dit == torch.bfloat16 and FP8.dit_float32 == BFLOAT16.dit_float32
    for block, before in zip(dit.blocks, original.blocks):
        assert all(isinstance(getattr(block, n), Fp8Linear) for n in ("qkv", "o", "ff_in", "ff_out"))
        want = pair_rows(before.ff_in.weight.bfloat16().float())
        assert rel_err(want, dequantize(block.ff_in.weight, torch.float32)) < 2**-4
    islands = [n for n, p in dit.named_parameters() if p.dtype == torch.float32]
    assert islands and all(not n.startswith("blocks.") or ".norm" in n for n in islands)


# Emulated FP8 on the tiny checkpoint (CPU, torch 2.13), against float32; bf16 beside it for scale:
#   talker, 12 teacher-forced frames, seeds 0..3: logits rel err mean 4.2e-2..4.3e-2, max 4.9e-2..5.3e-2;
#     c0 equal 67-92%, depth codes equal 54-75% (40 frames, seeds 0..2: bf16 6.5e-3 mean, c0 90%, depth 81%)
#   stage 1, 250 frames (2 windows), 4 steps, seeds 0..2: latent rel err 4.6e-2..4.8e-2, waveform SNR 13.0-13.1 dB
#     (450 frames, 8 steps: FP8 4.2e-2..4.3e-2 and 13.6 dB, bf16 3.7e-3 and 23.5 dB)
# e4m3's 2^-4 steps put FP8 ~10x further from float32 than bf16. Thresholds: ~25% over the worst measured.
TALKER_LOGITS_REL_ERR_MAX = 6.5e-2
TALKER_C0_EQUAL_MIN = 0.5
DIT_LATENT_REL_ERR_MAX = 6.0e-2
DIT_WAVEFORM_SNR_MIN_DB = 12.0


def test_emulated_fp8_talker_stays_within_measured_error(tiny_dir):
    lm = load_component(tiny_dir, "language_model", "cpu", torch.float32)
    depth = load_component(tiny_dir, "depth_decoder", "cpu", torch.float32)
    quantized = (copy.deepcopy(lm), copy.deepcopy(depth))
    quantize_talker(*quantized)
    report = talker_agreement((lm, depth), {"fp8": quantized}, frames=12, seed=0)[0]
    assert 1e-2 < max(report.logits_rel_err) <= TALKER_LOGITS_REL_ERR_MAX, report
    assert report.c0_equal >= TALKER_C0_EQUAL_MIN, report


def test_emulated_fp8_renderer_stays_within_measured_error(tiny_dir):
    def acoustic():
        return SimpleNamespace(**{n: load_component(tiny_dir, n, "cpu", torch.float32)
                                  for n in ("condition_encoder", "dit", "vocoder")})

    report = measure_precision(acoustic(), acoustic(), FP8, frames=250, seed=0, steps=4)
    assert 1e-2 < max(report.latent_rel_err) <= DIT_LATENT_REL_ERR_MAX, report
    assert report.waveform_snr_db >= DIT_WAVEFORM_SNR_MIN_DB, report
    assert report.vocoder_snr_db == float("inf"), report  # the vocoder is untouched


def test_fp8_never_changes_the_default_engine_output(tiny_dir):
    def song(quantization: str):
        pipeline = Pipeline.from_pretrained(tiny_dir, quantization=quantization)
        return pipeline, pipeline.generate("pop", "[verse] la la", 4.0, 3, steps=2)

    default, before = song("none")
    fp8, quantized = song("fp8")
    _, after = song("none")
    assert not any(isinstance(m, Fp8Linear) for m in default.models.language_model.modules())
    assert torch.equal(before.codes, after.codes) and (before.waveform == after.waveform).all()
    assert fp8.renderer.policy is FP8 and not torch.equal(before.codes, quantized.codes)


def test_quantization_settings_and_what_the_engine_says():
    deploy = load_deploy_config()
    assert [s.quantization for s in deploy.stages] == ["none", "none"] and deploy.stages[1].precision == "float32"
    fp8 = with_quantization(deploy, "fp8")
    assert [s.quantization for s in fp8.stages] == ["fp8", "fp8"] and fp8.stages[1].precision == "fp8"
    said = fp8.precisions()
    assert said["stage 0"].startswith("fp8: e4m3 weights") and "dtype float32 is overridden" in said["stage 1"]
    assert "about 5x slower than bfloat16" in deploy.precisions()["stage 1"]
    # Said as a warning where it costs: stage 1 in float32 on a GPU (the default deploy file's), not on the CPU.
    levels = {(p, d): precision_log_level(p, d) for p in ("float32", "bfloat16", "fp8") for d in ("cuda", "cpu")}
    assert [key for key, level in levels.items() if level == logging.WARNING] == [("float32", "cuda")]
    assert set(levels.values()) == {logging.WARNING, logging.INFO}
    with pytest.raises(ConfigError, match="allowed: none or fp8"):
        with_quantization(deploy, "int8")
    float32_talker = deploy.__class__(stages=(dataclasses.replace(deploy.stages[0], dtype="float32"), deploy.stages[1]))
    with pytest.raises(ConfigError, match="stage 0 has dtype float32"):
        with_quantization(float32_talker, "fp8")
    parser = build_parser()
    for argv in (["serve", "--tiny"], ["generate", "--caption", "a", "--lyrics", "b", "-o", "x.wav"]):
        assert parser.parse_args(argv).quantization is None
        assert parser.parse_args([*argv, "--quantization", "fp8"]).quantization == "fp8"
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--quantization", "int4"])


def test_load_models_quantizes_the_talker_as_it_reads_it(tiny_dir):
    models = load_models(tiny_dir, quantization="fp8")
    talker = [*models.language_model.modules(), *models.depth_decoder.modules()]
    assert not any(type(m) is nn.Linear for m in talker) and isinstance(models.depth_decoder.heads, Fp8Linear)
    assert all(p.dtype == torch.float32 for p in models.dit.parameters())  # stage 1 is its policy's to cast
    with pytest.raises(Music3Error, match="none or fp8"):
        load_models(tiny_dir, quantization="fp4")


def test_activation_rows_are_cast_by_the_weights_rule_and_the_cpu_ops_are_the_torch_ops():
    x = rows_to_cast(5, 64, "cpu")
    rows = quantize_rows(x)
    assert rows.codes.shape == x.shape and rows.scale.shape == (2, 5, 1)
    finite = ~rows.scale.isnan().squeeze(-1)
    assert torch.equal(rows.scale[finite], quantize(x.float()).scale[finite][:, None])
    assert torch.equal(rows.codes[finite].view(torch.uint8), quantize(x.float()).codes[finite].view(torch.uint8))
    assert rows.codes[1, 1].float().isnan().all()  # a NaN anywhere in a row: the whole row, as torch's amax says
    assert_same_rows(fp8_rows(x), rows)
    weight, bias = torch.randn(64), torch.randn(64)
    s, h = add_layer_norm_reference(x.float(), x, weight, bias, 1e-6, torch.bfloat16)
    got_s, got_rows = add_layer_norm_fp8(x.float(), x, weight, bias, 1e-6)
    torch.testing.assert_close(got_s, s, rtol=0, atol=0, equal_nan=True)
    assert_same_rows(got_rows, quantize_rows(h))


def test_the_fp8_dit_block_casts_each_gemm_input_once_where_it_is_fastest(tiny_dir, monkeypatch):
    """Each of a block's four FP8 GEMMs gets its input as codes: from the norm kernel's pass (qkv, ff_in), fp8_rows'
    kernel (o), the torch ops that inductor fuses with the gate (ff_out); without the norm kernel, fp8_rows."""
    from music3serve.models import dit as dit_module

    calls = []
    for name in ("fp8_rows", "quantize_rows", "add_layer_norm_fp8"):
        op = getattr(dit_module, name)
        monkeypatch.setattr(dit_module, name, lambda *a, _op=op, _name=name: calls.append(_name) or _op(*a))
    monkeypatch.setattr(dit_module, "uses_add_norm_kernel", lambda *operands: True)
    dit = load_component(tiny_dir, "dit", "cpu", torch.float32)
    apply_dit_policy(dit, FP8)
    block = dit.blocks[0]
    x = torch.randn(2, 7, dit.cfg.width)
    delta = torch.randn(2, 7, dit.cfg.width, dtype=torch.bfloat16)
    rope = dit_module.rope_angles(torch.arange(7), dit.cfg.rotary_dim, dit_module.ROPE_THETA)
    got = block(x, delta, rope)
    assert calls == ["add_layer_norm_fp8", "fp8_rows", "add_layer_norm_fp8", "quantize_rows"]
    calls.clear()
    monkeypatch.setattr(dit_module, "uses_add_norm_kernel", lambda *operands: False)
    want = block(x, delta, rope)  # the torch ops, each GEMM casting its own input
    assert calls == ["fp8_rows", "fp8_rows", "fp8_rows", "quantize_rows"]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_cast_ops_pass_torchs_custom_op_checks_on_strided_inputs():
    """Outputs never alias inputs and are laid out as the fake kernels say, whatever the input's strides."""
    x = torch.randn(2, 64, 5).transpose(1, 2)  # not contiguous
    weight, bias = torch.randn(64), torch.randn(64)
    torch.library.opcheck(torch.ops.music3serve.fp8_rows.default, (x.bfloat16(),))
    torch.library.opcheck(torch.ops.music3serve.add_layer_norm_fp8.default, (x, None, weight, bias, 1e-6))
    torch.library.opcheck(torch.ops.music3serve.add_layer_norm.default, (x, None, weight, bias, 1e-6, torch.bfloat16))
