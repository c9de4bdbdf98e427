"""Flow-matching Euler solver with guidance for one or more windows, and the overlap carry between windows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import contract
from ..hashing import MASK32, mix32
from ..models.dit import DiT


@dataclass
class Carry:
    """What a window hands to the next one of the same song."""

    latent: torch.Tensor  # [channels, columns]
    condition: torch.Tensor  # [columns, condition_dim]


def time_grid(steps: int) -> torch.Tensor:
    """float32 times t_0..t_steps (0 = noise, 1 = data), as the checkpoint's inverted-sigma scheduler lays them."""
    sigmas = np.linspace(1.0, 1.0 / steps, steps).astype(np.float32)
    times = 1.0 - torch.from_numpy(sigmas)
    return torch.cat([times, torch.ones(1)])


def noise(seed: int, window: int, length: int) -> torch.Tensor:
    """Initial noise [latent channels, length] of window `window` of the song with `seed` (CPU-generated)."""
    low = (seed * 0x9E3779B1 + window * 0x85EBCA77 + 0x27D4EB2F) & MASK32
    # The CPU generator (mt19937) keeps only a seed's low 32 bits, where the seed's own high bits do not reach:
    # hashed in there, they tell s from s + 2**32 (mix32(0) == 0: seeds below 2**32 use the low key alone).
    generator = torch.Generator().manual_seed(low ^ mix32(seed >> 32))
    return torch.randn(1, contract.LATENT_CHANNELS, length, generator=generator)[0]


def solve(
    dit: DiT,
    condition: list[torch.Tensor],
    initial: list[torch.Tensor],
    carries: list[Carry | None],
    steps: int = contract.DIT_STEPS,
) -> list[torch.Tensor]:
    """Denoise windows of equal latent length in one batch; returns each window's latent [channels, length].

    condition[i] is [length, condition_dim] with the overlap already spliced in; initial[i] is the noise.
    """
    x = torch.stack(initial).to(dit.proj_in.weight.device, torch.float32)
    cond = torch.stack(condition).to(x.device, dit.proj_in.weight.dtype)
    both = torch.cat([cond, torch.zeros_like(cond)])
    overlaps = [0 if c is None else min(c.latent.shape[-1], x.shape[-1]) for c in carries]
    prompts = [x[i, :, :ov].clone() for i, ov in enumerate(overlaps)]
    times = time_grid(steps).to(x.device)
    for k in range(steps):
        t = times[k]
        for i, ov in enumerate(overlaps):
            if ov:
                x[i, :, :ov] = (1.0 - (1.0 - contract.NOISE_PROMPT_EPS) * t) * prompts[i] + t * carries[i].latent[:, :ov]
        # t stays float32: the DiT's Fourier time embedding reads it in float32 (bf16 would round t by up to 2^-9).
        velocity = dit(torch.cat([x, x]).to(cond.dtype), t.expand(2 * len(x)), both).float()
        v_cond, v_uncond = velocity.chunk(2)
        x = x + (times[k + 1] - t) * (v_uncond + contract.DIT_CFG_SCALE * (v_cond - v_uncond))
    for i, ov in enumerate(overlaps):
        if ov:
            x[i, :, :ov] = carries[i].latent[:, :ov]
    return list(x)
