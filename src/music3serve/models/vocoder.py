"""DAC-style vocoder: latents [batch, 128, L] -> stereo waveform [batch, 2, 512 L] (channels folded in batch)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .fusion import between_library_calls, hot
from .weights import ParamSource, Source, WeightNormSource, require

DILATIONS = (1, 3, 9)


@dataclass(frozen=True)
class VocoderConfig:
    latent_channels: int
    input_dim: int
    hidden: int
    strides: tuple[int, ...]
    sample_rate: int

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> "VocoderConfig":
        return cls(
            latent_channels=require(cfg, "latent_channels"),
            input_dim=require(cfg, "decoder_input_dim"),
            hidden=require(cfg, "decoder_hidden_dim"),
            strides=tuple(require(cfg, "upsampling_ratios")),
            sample_rate=require(cfg, "sampling_rate"),
        )

    def widths(self) -> list[tuple[int, int]]:
        return [(self.hidden >> i, self.hidden >> (i + 1)) for i in range(len(self.strides))]


class Snake(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A plain tensor, not the Parameter: dynamo keeps parameters' shapes static, so every width of the vocoder
        # compiled its own snake and a ninth width hit the recompile limit (a hard error under fullgraph).
        return snake(x, self.alpha.detach().view(-1))


@between_library_calls
@hot
def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """x + sin^2(alpha x) / alpha per channel, alpha [channels]: one pass over x once fused (eager, six kernels over
    the window's largest tensors). Its broadcast dimension is made here, a static 1 for the compiler."""
    alpha = alpha[:, None]
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.snake1 = Snake(dim)
        self.conv1 = nn.Conv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake(dim)
        self.conv2 = nn.Conv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class UpsampleBlock(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, stride: int):
        super().__init__()
        self.snake = Snake(dim_in)
        self.up = nn.ConvTranspose1d(dim_in, dim_out, 2 * stride, stride=stride, padding=math.ceil(stride / 2))
        self.units = nn.Sequential(*(ResidualUnit(dim_out, d) for d in DILATIONS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.units(self.up(self.snake(x)))


class Vocoder(nn.Module):
    def __init__(self, cfg: VocoderConfig):
        super().__init__()
        self.cfg = cfg
        self.latent_in = nn.Conv1d(cfg.latent_channels // 2, cfg.input_dim, 1)
        self.conv_in = nn.Conv1d(cfg.input_dim, cfg.hidden, 7, padding=3)
        self.blocks = nn.Sequential(*(UpsampleBlock(a, b, s) for (a, b), s in zip(cfg.widths(), cfg.strides)))
        self.snake_out = Snake(cfg.widths()[-1][1])
        self.conv_out = nn.Conv1d(cfg.widths()[-1][1], 1, 7, padding=3)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        b, _, length = latents.shape
        x = latents.reshape(2 * b, self.cfg.latent_channels // 2, length).to(self.conv_in.weight.dtype)
        x = self.blocks(self.conv_in(self.latent_in(x)))
        return torch.tanh(self.conv_out(self.snake_out(x))).reshape(b, 2, -1)

    @staticmethod
    def checkpoint_sources(cfg: VocoderConfig) -> dict[str, ParamSource]:
        """Where each parameter comes from in the diffusers layout; weight-normed convs are folded."""
        sources: dict[str, ParamSource] = {
            "latent_in.weight": [Source("dec_in_proj.weight", (cfg.input_dim, cfg.latent_channels // 2, 1))],
            "latent_in.bias": [Source("dec_in_proj.bias", (cfg.input_dim,))],
        }

        def conv(ours: str, theirs: str, shape: tuple[int, ...], channels: int) -> None:
            sources[ours + ".weight"] = WeightNormSource(theirs, shape)
            sources[ours + ".bias"] = [Source(theirs + ".bias", (channels,))]

        def snake(ours: str, theirs: str, channels: int) -> None:
            sources[ours + ".alpha"] = [Source(theirs + ".alpha", (1, channels, 1))]

        conv("conv_in", "conv_in", (cfg.hidden, cfg.input_dim, 7), cfg.hidden)
        for i, ((dim_in, dim_out), stride) in enumerate(zip(cfg.widths(), cfg.strides)):
            ours, theirs = f"blocks.{i}.", f"blocks.{i}."
            snake(ours + "snake", theirs + "snake1", dim_in)
            conv(ours + "up", theirs + "conv_t1", (dim_in, dim_out, 2 * stride), dim_out)
            for u in range(len(DILATIONS)):
                o, t = f"{ours}units.{u}.", f"{theirs}res_unit{u + 1}."
                snake(o + "snake1", t + "snake1", dim_out)
                conv(o + "conv1", t + "conv1", (dim_out, dim_out, 7), dim_out)
                snake(o + "snake2", t + "snake2", dim_out)
                conv(o + "conv2", t + "conv2", (dim_out, dim_out, 1), dim_out)
        last = cfg.widths()[-1][1]
        snake("snake_out", "snake_out", last)
        conv("conv_out", "conv_out", (1, last, 7), 1)
        return sources
