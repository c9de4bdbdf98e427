"""Measuring a precision policy's cost against float32: one song rendered both ways, same weights, conditioning and
noise (docs/precision.md). The policies themselves are the engine's (acoustic/precision.py)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from .. import contract
from ..acoustic.precision import BFLOAT16, FLOAT32, PrecisionPolicy
from ..acoustic.renderer import Renderer
from ..checkpoint import ACOUSTIC, load_component


def snr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    """10 log10(|reference|^2 / |reference - other|^2), in float64."""
    reference, other = reference.double(), other.double()
    noise = (reference - other).pow(2).sum().item()
    return math.inf if noise == 0 else 10.0 * math.log10(reference.pow(2).sum().item() / noise)


def rel_err(reference: torch.Tensor, other: torch.Tensor) -> float:
    reference, other = reference.double(), other.double()
    return float((reference - other).norm() / reference.norm().clamp_min(1e-30))


@dataclass
class PrecisionReport:
    policy: str
    latent_rel_err: list[float]  # per window, the carry lets errors build up from window to window
    waveform_snr_db: float  # the whole song (cropped, clamped) against float32
    vocoder_snr_db: float  # the policy's vocoder alone on the float32 latents, against the float32 vocoder
    extra: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        errs = ", ".join(f"{e:.2e}" for e in self.latent_rel_err)
        return (f"{self.policy}: latent rel err [{errs}], waveform SNR {self.waveform_snr_db:.1f} dB, "
                f"vocoder SNR {self.vocoder_snr_db:.1f} dB")


def measure_precision(
    models_fp32: Any,
    models_low: Any,
    policy: PrecisionPolicy = BFLOAT16,
    frames: int = 450,
    seed: int = 0,
    steps: int = contract.DIT_STEPS,
    conditioning: torch.Tensor | None = None,
) -> PrecisionReport:
    """Render one song with float32 and with `policy` (same conditioning and noise) and compare.

    models_* carry condition_encoder, dit and vocoder (Music3Models will do); models_low is cast to `policy` in
    place, so load it in float32 for true float32 islands. conditioning is [frames, streams * hidden] (random by
    default, seeded)."""
    return compare_policies(models_fp32, lambda: models_low, [policy], frames, seed, steps, conditioning)[0]


def compare_policies(
    models_fp32: Any,
    load_low: Callable[[], Any],
    policies: list[PrecisionPolicy],
    frames: int = 450,
    seed: int = 0,
    steps: int = contract.DIT_STEPS,
    conditioning: torch.Tensor | None = None,
) -> list[PrecisionReport]:
    """measure_precision for several policies against one float32 render; load_low() gives fresh float32 models."""
    reference = Renderer.from_models(models_fp32, FLOAT32)
    if conditioning is None:
        cfg = reference.encoder.cfg
        conditioning = torch.randn(frames, cfg.streams * cfg.hidden, generator=torch.Generator().manual_seed(seed))
    mixed = reference.mix(conditioning)
    wave_ref, lat_ref = reference.render_song(mixed, seed, steps, song="reference")
    voc_ref = torch.cat([w.flatten() for w in reference.vocode(lat_ref)])
    reports = []
    for policy in policies:
        low = Renderer.from_models(load_low(), policy)
        wave_low, lat_low = low.render_song(mixed, seed, steps, song="low")
        voc_low = torch.cat([w.flatten() for w in low.vocode(lat_ref)])
        reports.append(PrecisionReport(
            policy=policy.name,
            latent_rel_err=[rel_err(a, b) for a, b in zip(lat_ref, lat_low)],
            waveform_snr_db=snr_db(wave_ref, wave_low),
            vocoder_snr_db=snr_db(voc_ref, voc_low),
        ))
    return reports


def main(argv: list[str] | None = None) -> None:
    """python -m music3serve.bench.precision ROOT [--device cuda] [--frames 450] [--steps 30] [--conditioning F]"""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("root", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--frames", type=int, default=450)
    parser.add_argument("--steps", type=int, default=contract.DIT_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conditioning", type=Path, help="torch.save'd [frames, 8 * hidden] talker conditioning")
    args = parser.parse_args(argv)
    conditioning = torch.load(args.conditioning) if args.conditioning else None

    def load() -> SimpleNamespace:
        return SimpleNamespace(**{n: load_component(args.root, n, args.device, torch.float32) for n in ACOUSTIC})

    with torch.inference_mode():
        print(measure_precision(load(), load(), BFLOAT16, args.frames, args.seed, args.steps, conditioning))


if __name__ == "__main__":
    main()
