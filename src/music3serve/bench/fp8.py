"""FP8 against bf16 and float32 (docs/precision.md, docs/performance.md): the talker teacher-forced, stage 1, the
engine's peak memory in FP8 under a memory cap, and (fp8_kernel.py) the skinny kernel on e4m3 weights.

    python -m music3serve.bench.fp8 {precision,kernel,sweep,memory}
"""

from __future__ import annotations

import argparse
import copy
import statistics
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import contract
from ..models.depth_decoder import DepthDecoder
from ..models.language_model import KVCache, LanguageModel
from ..talker.frame import talker_frame
from ..talker.quantize import quantize_talker
from .common import random_module
from .fp8_kernel import SHAPES, VARIANTS, kernel_bandwidth, sweep_tiles
from .precision import rel_err


@dataclass
class TalkerAgreement:
    """One talker variant against the float32 reference over teacher-forced frames."""

    name: str
    logits_rel_err: list[float]  # per frame: the backbone's legal-column logits (cond and uncond rows)
    c0_equal: float  # share of frames whose drawn c0 equals float32's (same draws)
    depth_equal: float  # share of the 7 depth codes equal to float32's, over all frames

    def __str__(self) -> str:
        errs = self.logits_rel_err
        return (f"{self.name}: logits rel err mean {statistics.fmean(errs):.2e} max {max(errs):.2e} over {len(errs)} "
                f"frames; c0 equal {self.c0_equal:.1%}, depth codes equal {self.depth_equal:.1%}")


@torch.inference_mode()
def talker_agreement(
    reference: tuple[LanguageModel, DepthDecoder], variants: dict[str, tuple[LanguageModel, DepthDecoder]],
    frames: int = 500, prompt: int = 64, seed: int = 0,
) -> list[TalkerAgreement]:
    """Every model pair fed the same inputs: a random two-row prompt, then each frame the float32 reference's feedback
    embedding; each draws its codes from its own logits with the same (seed, frame) draws (talker_frame)."""
    models = {"float32": reference, **variants}
    lm = reference[0]
    device = lm.embed.weight.device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, contract.AUDIO_CODE_OFFSET, (2, prompt), generator=gen).to(device)
    ids[:, -1] = contract.AUDIO_START
    caches = {n: KVCache.allocate(m[0].cfg, 2, prompt + frames, m[0].embed.weight.dtype, device) for n, m in models.items()}
    hidden = {n: m[0](m[0].embed(ids), torch.arange(prompt, device=device), caches[n].at(0))[:, -1]
              for n, m in models.items()}
    seeds = torch.tensor([seed], device=device)
    errs: dict[str, list[float]] = {n: [] for n in variants}
    c0 = dict.fromkeys(variants, 0)
    depth_codes = dict.fromkeys(variants, 0)
    for frame in range(frames):
        index = torch.tensor([frame], device=device)
        ref_logits = lm.logits(hidden["float32"])
        ref = talker_frame(*reference, hidden["float32"], seeds, index, depth_cache=False)
        for name in variants:
            v_lm, v_depth = variants[name]
            errs[name].append(rel_err(ref_logits, v_lm.logits(hidden[name])))
            codes = talker_frame(v_lm, v_depth, hidden[name], seeds, index, depth_cache=False).codes
            c0[name] += int(codes[0, 0] == ref.codes[0, 0])
            depth_codes[name] += int((codes[0, 1:] == ref.codes[0, 1:]).sum())
        position = torch.tensor([prompt + frame], device=device)
        for name, (m_lm, _) in models.items():
            feedback = ref.feedback.to(m_lm.embed.weight.dtype)[:, None]
            hidden[name] = m_lm(feedback, position, caches[name].at(prompt + frame))[:, -1]
    return [TalkerAgreement(n, errs[n], c0[n] / frames, depth_codes[n] / (7 * frames)) for n in variants]


def talker_precision(device: str = "cuda", frames: int = 500) -> str:
    """Full-size random weights (bf16, as the checkpoint stores them): float32 upcast as the reference, bf16, FP8."""
    lm = random_module("language_model", device, torch.bfloat16)
    depth = random_module("depth_decoder", device, torch.bfloat16, seed=1)
    reference = (copy.deepcopy(lm).float(), copy.deepcopy(depth).float())
    quantized = (copy.deepcopy(lm), copy.deepcopy(depth))
    quantize_talker(*quantized)
    reports = talker_agreement(reference, {"bf16": (lm, depth), "fp8": quantized}, frames=frames)
    return "\n".join(str(r) for r in reports)


@torch.inference_mode()
def acoustic_precision(device: str = "cuda", frames: int = 450) -> str:
    """Stage 1 on full-size random weights: one song rendered in float32, bf16 and FP8 from the same conditioning and
    noise; per-window latent relative error and waveform SNR against float32."""
    from ..acoustic.precision import BFLOAT16, FP8
    from .precision import compare_policies

    def load() -> SimpleNamespace:
        return SimpleNamespace(**{name: random_module(name, device, torch.float32, seed=seed)
                                  for seed, name in enumerate(("condition_encoder", "dit", "vocoder"))})

    reports = compare_policies(load(), load, [BFLOAT16, FP8], frames=frames)
    return "\n".join(str(r) for r in reports)


EXAMPLE_24GB = Path(__file__).resolve().parents[3] / "examples" / "deploy" / "fp8_24gb.yaml"  # in the source tree


def memory(device: str = "cuda", cap_gib: float = 22.0, seconds: float = 20.0) -> str:
    """The engine colocated as examples/deploy/fp8_24gb.yaml says (FP8, 2 songs at max_model_len 10240) under
    torch.cuda.set_per_process_memory_fraction of `cap_gib`: one song, then the peak memory reserved. The file's
    shares are of the whole card here, so only the cap binds."""
    import asyncio
    import time

    from ..serving.deploy_config import load_deploy_config
    from ..serving.engine import Engine
    from .e2e import random_models, song

    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, torch.device(device).index or 0)
    deploy = load_deploy_config(EXAMPLE_24GB)
    started = time.perf_counter()
    engine = Engine(random_models(device, quantize=True), deploy)
    ready = time.perf_counter() - started
    try:
        result = asyncio.run(song(engine, seconds, 0))
    finally:
        engine.close()
    peak = torch.cuda.max_memory_reserved(device) / 2**30
    return (f"FP8 engine under a {cap_gib:g} GiB cap: ready in {ready:.1f} s, one {seconds:g} s song in "
            f"{result['total_s']:.2f} s (first audio {result['first_audio_s']:.2f} s); peak reserved {peak:.2f} GiB")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["precision", "kernel", "sweep", "memory"])
    parser.add_argument("--frames", type=int, default=500)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="sweep: the kernel variants to time (each tile in each)")
    parser.add_argument("--weights", nargs="+", choices=[s[0] for s in SHAPES], default=[s[0] for s in SHAPES],
                        help="sweep: the talker weights to time")
    parser.add_argument("--talker", action="store_true",
                        help="sweep: then the talker step in bf16 and FP8 with the fastest tiles found (1 and 8 songs)")
    args = parser.parse_args(argv)
    if args.what == "precision":
        print(talker_precision(frames=args.frames))
        print(acoustic_precision())
    elif args.what == "kernel":
        print(kernel_bandwidth())
    elif args.what == "sweep":
        print(sweep_tiles(variants=args.variants, weights=args.weights))
        if args.talker:
            from . import talker

            print(talker.run(concurrency=(1, 8), peers=False, quantization="fp8"))
    else:
        print(memory())


if __name__ == "__main__":
    main()
