"""The skinny kernel on e4m3 weights (docs/performance.md): its bandwidth per talker weight beside bf16, and a sweep of
its tiles and variants, each checked against the exact product. Run through `python -m music3serve.bench.fp8
{kernel,sweep}`."""

from __future__ import annotations

import torch

from ..kernels.skinny_linear_kernel import VARIANTS
from .common import copy_bandwidth, graphed, table, time_ms


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
        bf16.clear()  # free the copies before the next weight
        fp8.clear()
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
        fp8.clear()
        checks.clear()
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
