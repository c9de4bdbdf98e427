"""FP8 against bf16 and float32 (docs/precision.md, docs/performance.md): the talker teacher-forced, the skinny kernel's
bandwidth on e4m3 weights, and the engine's peak memory in FP8 under a memory cap.

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
from ..kernels.skinny_linear_kernel import VARIANTS
from ..models.depth_decoder import DepthDecoder
from ..models.language_model import KVCache, LanguageModel
from ..talker.frame import talker_frame
from ..talker.quantize import quantize_talker
from .common import copy_bandwidth, graphed, random_module, table, time_ms
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


# (name, N, K, gated): the talker's weights (bench/skinny_linear.py has the calls per frame).
SHAPES = [("lm qkv", 6144, 4096, False), ("lm o", 4096, 4096, False), ("lm gate_up + silu", 24576, 4096, True),
          ("lm down", 4096, 12288, False), ("lm head", 16385, 4096, False), ("depth qkv", 12288, 4096, False),
          ("depth down", 4096, 6144, False), ("depth gate_up + silu", 12288, 4096, True),
          ("depth heads", 1024, 4096, False)]
CYCLE_BYTES = 512 << 20  # weights cycled per timed graph, past the L2


@torch.inference_mode()
def kernel_bandwidth(device: str = "cuda", rows=(2, 16)) -> str:
    """The skinny kernel per talker weight, bf16 and e4m3 weights: microseconds and weight bytes over time against
    copy bandwidth (the weights cycling through more copies than L2 holds)."""
    from ..kernels.skinny_linear import skinny_gated_silu, skinny_linear
    from ..models.fp8 import quantize

    out = []
    for name, n, k, gated in SHAPES:
        copies = max(2, CYCLE_BYTES // (n * k * 2))
        bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        fp8 = [quantize(w) for w in bf16]
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            fn = skinny_gated_silu if gated else skinny_linear
            if gated:
                calls = {"bf16": lambda: [fn(x, w) for w in bf16], "fp8": lambda: [fn(x, q.codes, q.scale) for q in fp8]}
            else:
                calls = {"bf16": lambda: [fn(x, w) for w in bf16],
                         "fp8": lambda: [fn(x, q.codes, None, q.scale) for q in fp8]}
            us = {label: time_ms(graphed(call)) / copies * 1e3 for label, call in calls.items()}
            share = {label: n * k * (2 if label == "bf16" else 1) / (us[label] * 1e-6) / copy_bandwidth()
                     for label in us}
            out.append([name, m, us["bf16"], us["fp8"], us["bf16"] / us["fp8"], share["bf16"], share["fp8"]])
        del bf16, fp8
        torch.cuda.empty_cache()
    return table(["weight", "rows", "bf16 us", "fp8 us", "speed-up", "bf16 x copy bw", "fp8 x copy bw"], out)


SWEEP = [(32, 512, 4, 4), (32, 1024, 4, 3), (64, 512, 4, 3), (64, 512, 8, 4), (64, 256, 4, 6), (128, 256, 8, 4),
         (32, 512, 8, 6), (16, 1024, 4, 4), (64, 1024, 8, 3), (32, 256, 4, 8),
         (32, 1024, 4, 4), (32, 512, 4, 7)]  # the last two: 96 KB of e4m3 in shared buffers, as bf16's (32, 512, 4, 4)


def every_code(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes [n, k] cycling through every finite code (zeros and subnormals of both signs), and scales."""
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8, device=device)
    codes = finite[torch.randperm(n * k, device=device) % len(finite)].view(n, k).view(torch.float8_e4m3fn)
    return codes, (torch.rand(n, device=device) + 0.5) / 256  # results of a few units: no overflow in silu


def variant_of(config: tuple) -> str:
    """The kernel variant a tile names (default "cvt")."""
    return config[4] if len(config) > 4 else "cvt"


def agrees(variant: str, got: torch.Tensor, cvt: torch.Tensor, exact: torch.Tensor) -> bool:
    """A variant with "cvt"'s order of sums gives its bits; one with K over the warps (another order) stays within the
    bound of the interpreted tests against the exact product: two bf16 steps of the largest value, one of the norm."""
    if not VARIANTS[variant][1]:
        return torch.equal(got, cvt)
    diff, step = (got.double() - exact).abs(), 2.0**-7
    return bool(diff.max() <= 2 * step * exact.abs().max() and diff.norm() <= step * exact.norm())


@torch.inference_mode()
def sweep_tiles(device: str = "cuda", rows: int = 16, variants: list[str] | None = None,
                weights: list[str] | None = None) -> str:
    """Time the skinny kernel on e4m3 weights for each talker shape over SWEEP (BLOCK_N per half when gated) in each
    kernel variant (skinny_linear_kernel.VARIANTS), check each variant's results (`agrees`, on a random weight and one
    of every finite code, every tile), and put the fastest (tile, variant) of those that agree in
    skinny_linear.MEASURED_FP8_TILES for this process; returns the table. `variants`, `weights`: those only (default
    all); each weight's row also goes to stdout as soon as it is timed."""
    from ..kernels import skinny_linear as sl
    from ..kernels.skinny_linear_kernel import run_kernel
    from ..models.fp8 import quantize

    variants = variants or list(VARIANTS)
    out = []
    for name, n, k, gated in (s for s in SHAPES if weights is None or s[0] in weights):
        copies = max(2, CYCLE_BYTES // (n * k))
        fp8 = [quantize(torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5) for _ in range(copies)]
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        checks = [(c, s, exact_product(x, c, s, gated))
                  for c, s in [(fp8[0].codes, fp8[0].scale), every_code(n, k, device)]]
        default = sl.tile_config(n, k, gated, fp8=True)
        us, ok = {}, dict.fromkeys(variants, True)
        for config in dict.fromkeys([default, *((*tile, v) for tile in SWEEP for v in variants)]):
            try:
                us[config] = time_ms(graphed(lambda c=config: [run_kernel(x, q.codes, c, gated=gated,
                                                                           scale=q.scale) for q in fp8])) / copies * 1e3
            except Exception as exc:  # a tile past the shared memory or register budget
                print(f"{name} {config}: {type(exc).__name__}")
                continue
            ok.setdefault(variant_of(config), True)
            ok[variant_of(config)] &= all(
                agrees(variant_of(config), run_kernel(x, c, config, gated=gated, scale=s),
                       run_kernel(x, c, config[:4], gated=gated, scale=s), exact) for c, s, exact in checks)
        best = {v: min((c for c in us if variant_of(c) == v), key=us.get, default=None) for v in variants}
        fastest = min((best[v] for v in variants if best[v] and ok[v]), key=us.get, default=None)
        if default not in us or fastest is None:
            print(f"{name}: the default tile {default} did not run or no variant agreed; its tile stays", flush=True)
            continue
        sl.MEASURED_FP8_TILES[(n, k, gated)] = fastest
        per_variant = [v for w in variants for v in ((str(best[w][:4]), us[best[w]]) if best[w] else ("-", "-"))]
        out.append([name, rows, str(default), us[default], *per_variant, str(fastest),
                    n * k / (us[fastest] * 1e-6) / copy_bandwidth(), ", ".join(v for v in ok if not ok[v]) or "-"])
        print(" | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in out[-1]), flush=True)
        del fp8, checks
        torch.cuda.empty_cache()
    columns = [col for v in variants for col in (f"best {v} tile", "us")]
    return table(["weight", "rows", "default tile", "us", *columns, "fastest", "x copy bw", "off (results)"], out)


def exact_product(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, gated: bool) -> torch.Tensor:
    """The kernel's result in float64 from the exact float64 product (gated: silu(gate) * up, each rounded to bf16 as
    the kernel rounds them)."""
    y = (x.double() @ codes.double().T) * scale.double()
    if not gated:
        return y
    gate, up = y.to(torch.bfloat16).float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate).to(torch.bfloat16).float() * up).double()


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
