"""Classifier-free guidance and top-k sampling by counter-based Gumbel draws.

A draw is a pure function of (seed, frame, codebook, column), so a seed fixes a song whatever else runs
in the batch and on whichever device. Sampling top-k with probabilities softmax(logits) is done as
argmax(logits + Gumbel noise) over the kept columns, which has exactly that distribution.
"""

from __future__ import annotations

import torch

from ..hashing import MASK32, mix32
from ..kernels.top_k import kth_largest
from ..models.fusion import hot


def uniform_draws(seeds: torch.Tensor, frames: torch.Tensor, codebook: int, columns: int) -> torch.Tensor:
    """float32 uniforms in (0, 1), shape [rows, columns], keyed by (seed, frame, codebook, column) per row."""
    seeds, frames = seeds.to(torch.int64), frames.to(torch.int64)  # seeds: hashing.as_int64 of 64-bit seeds
    state = mix32((seeds & MASK32) ^ mix32((seeds >> 32) & MASK32))
    state = mix32(state ^ mix32(frames & MASK32))
    state = mix32(state ^ mix32(torch.full_like(state, codebook + 0x9E37)))
    column = torch.arange(columns, device=seeds.device, dtype=torch.int64)
    bits = mix32(state[:, None] ^ mix32(column + 0x51ED27)[None, :])
    # 23 bits: (2**23 - 0.5) / 2**23 is exact in float32, so u < 1 and every Gumbel term is finite.
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def guide(logits: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split interleaved [cond, uncond, ...] rows and blend: uncond + (cond - uncond) * scale."""
    cond, uncond = logits[0::2], logits[1::2]
    return cond, uncond + (cond - uncond) * scale


def keep_top_k(logits: torch.Tensor, k: int, reference: torch.Tensor | None = None) -> torch.Tensor:
    """-inf wherever `reference` (default: logits) is below its k-th largest value; ties are kept."""
    reference = logits if reference is None else reference
    threshold = kth_largest(reference, min(k, reference.shape[-1]))
    return logits.masked_fill(reference < threshold, float("-inf"))


def gumbel_sample(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """argmax(logits - log(-log u)): a draw from softmax(logits) over the finite columns."""
    return torch.argmax(logits.float() - torch.log(-torch.log(uniforms)), dim=-1)


@hot
def sample_top_k(
    logits: torch.Tensor, k: int, seeds: torch.Tensor, frames: torch.Tensor, codebook: int
) -> torch.Tensor:
    """Top-k sampling (temperature 1) with the counter-based draws of (seed, frame, codebook)."""
    kept = keep_top_k(torch.nan_to_num(logits.float(), nan=float("-inf")), k)
    return gumbel_sample(kept, uniform_draws(seeds, frames, codebook, logits.shape[-1]))


@hot
def guided_draw(
    logits: torch.Tensor, scale: float, k: int, seeds: torch.Tensor, frames: torch.Tensor, codebook: int,
    cond_top_k: int = 0,
) -> torch.Tensor:
    """One code per song from interleaved [cond, uncond] logit rows: the guidance blend, with `cond_top_k` the
    columns outside the conditional row's top cond_top_k dropped, then the top-k draw. One hot path, so the
    blend fuses with the draw's kernels."""
    cond, guided = guide(logits.float(), scale)
    if cond_top_k:
        guided = keep_top_k(guided, cond_top_k, reference=cond)
    return sample_top_k(guided, k, seeds, frames, codebook)
