"""Flow-matching Euler solver with guidance for one or more windows, the overlap carry between windows, and the
same loop captured as a CUDA graph for full-length windows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import contract
from ..hashing import MASK32, mix32
from ..models.dit import DiT

FULL_LENGTH = contract.latent_length(contract.WINDOW_FRAMES)  # 689: every window but a song's last
WARMUP_STEPS = 1  # Euler steps run eagerly before a capture or as a throwaway render: every kernel and shape once


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


def prompt_blend(prompt: torch.Tensor, carry: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The overlap columns at time t: the noise prompt moving to the previous window's carried latent."""
    return (1.0 - (1.0 - contract.NOISE_PROMPT_EPS) * t) * prompt + t * carry


def guided_step(dit: DiT, x: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor, both: torch.Tensor) -> torch.Tensor:
    """One Euler step from t to t_next with guidance; `both` holds the cond rows, then zeros for the uncond ones."""
    # t stays float32: the DiT's Fourier time embedding reads it in float32 (bf16 would round t by up to 2^-9).
    velocity = dit(torch.cat([x, x]).to(both.dtype), t.expand(2 * len(x)), both).float()
    v_cond, v_uncond = velocity.chunk(2)
    return x + (t_next - t) * (v_uncond + contract.DIT_CFG_SCALE * (v_cond - v_uncond))


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
                x[i, :, :ov] = prompt_blend(prompts[i], carries[i].latent[:, :ov], t)
        x = guided_step(dit, x, t, times[k + 1], both)
    for i, ov in enumerate(overlaps):
        if ov:
            x[i, :, :ov] = carries[i].latent[:, :ov]
    return list(x)


def euler_masked(
    dit: DiT, initial: torch.Tensor, condition: torch.Tensor, carry: torch.Tensor, mask: torch.Tensor, times: torch.Tensor
) -> torch.Tensor:
    """solve() with tensor ops only, for a CUDA graph: every window gets the overlap splice of width
    carry.shape[-1], masked off (mask [batch, 1, 1] False) for first windows. condition is [2 batch, L, dim]: the
    cond rows, then zeros for the uncond ones. The same steps as solve()."""
    x = initial.clone()
    ov = carry.shape[-1]
    prompt = x[..., :ov].clone()
    for k in range(len(times) - 1):
        t = times[k]
        x[..., :ov] = torch.where(mask, prompt_blend(prompt, carry, t), x[..., :ov])
        x = guided_step(dit, x, t, times[k + 1], condition)
    x[..., :ov] = torch.where(mask, carry, x[..., :ov])
    return x


class GraphedSolve:
    """The whole Euler loop for `batch` full-length windows, captured once as a CUDA graph and replayed."""

    def __init__(self, dit: DiT, batch: int, steps: int, stream: torch.cuda.Stream, pool: Any = None):
        device, dtype = dit.proj_in.weight.device, dit.proj_in.weight.dtype
        channels, overlap = dit.cfg.channels, min(contract.OVERLAP_LATENT, FULL_LENGTH)
        self.batch = batch
        self.initial = torch.zeros(batch, channels, FULL_LENGTH, device=device)
        self.condition = torch.zeros(2 * batch, FULL_LENGTH, dit.cfg.condition, device=device, dtype=dtype)
        self.carry = torch.zeros(batch, channels, overlap, device=device)
        self.mask = torch.zeros(batch, 1, 1, dtype=torch.bool, device=device)
        self.times = time_grid(steps).to(device)

        def run() -> torch.Tensor:
            return euler_masked(dit, self.initial, self.condition, self.carry, self.mask, self.times)

        # Warm-up, capture and replay all on the renderer's stream: its cuBLAS workspace is its own.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # Warm-up off the capture: lazy inits, cuBLAS workspaces, kernel choices and compiles need each kernel
            # and shape once, and one Euler step has them all (every step runs the same ops on the same shapes).
            euler_masked(dit, self.initial, self.condition, self.carry, self.mask, self.times[:WARMUP_STEPS + 1])
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=stream):
                self.output = run()
        stream.synchronize()

    def __call__(self, condition: list[torch.Tensor], initial: list[torch.Tensor], carries: list[Carry | None]):
        self.initial.copy_(torch.stack(initial))
        self.condition[: self.batch].copy_(torch.stack(condition))
        self.mask.copy_(torch.tensor([c is not None for c in carries]).view(-1, 1, 1))
        for i, c in enumerate(carries):
            if c is not None:
                self.carry[i].copy_(c.latent[:, : self.carry.shape[-1]])
        self.graph.replay()
        return list(self.output.clone())
