"""The README's memory table against the model code at full size (meta tensors: nothing is allocated)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from music3serve.acoustic.precision import BFLOAT16, FLOAT32, FP8, apply_policy
from music3serve.bench.common import FULL_CONFIGS
from music3serve.checkpoint_layout import COMPONENTS
from music3serve.talker.quantize import quantize_talker

README = Path(__file__).resolve().parents[1] / "README.md"


def full_size(name: str, dtype: torch.dtype) -> torch.nn.Module:
    component = COMPONENTS[name]
    with torch.device("meta"):
        return component.model(component.config(FULL_CONFIGS[name])).to(dtype)


def gigabytes(*modules: torch.nn.Module) -> float:
    return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers())) / 1e9


def readme_row(label: str) -> list[float]:
    """The GB figures of the README's memory-table row starting with `label`: FP8, bf16, float32."""
    row = next(line for line in README.read_text().splitlines() if line.startswith(f"| {label}"))
    return [float(cell) for cell in re.findall(r"\| ([\d.]+) GB", row)]


def test_the_readme_gives_the_talkers_weight_bytes_the_code_holds():
    lm, depth = full_size("language_model", torch.bfloat16), full_size("depth_decoder", torch.bfloat16)
    bf16 = gigabytes(lm, depth)
    quantize_talker(lm, depth)
    fp8 = gigabytes(lm, depth)
    assert readme_row("talker weights") == [round(fp8, 1), round(bf16, 1), round(2 * bf16, 1)]


def test_the_readme_gives_the_acoustic_decoders_weight_bytes_the_code_holds():
    """Each precision's policy casts the modules as the engine does (some float32 islands stay in bf16 and FP8)."""
    held = []
    for policy in (FP8, BFLOAT16, FLOAT32):
        modules = [full_size(name, torch.float32) for name in ("condition_encoder", "dit", "vocoder")]
        apply_policy(*modules, policy)
        held.append(round(gigabytes(*modules), 1))
    assert readme_row("acoustic decoder weights") == held
