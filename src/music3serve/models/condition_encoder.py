"""Condition encoder: mixes the 8 per-frame hidden streams, projects them, and resamples to latent rate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import contract
from ..errors import CheckpointError
from .fusion import hot
from .weights import Source, require


@dataclass(frozen=True)
class ConditionEncoderConfig:
    hidden: int
    streams: int
    out_dim: int

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> "ConditionEncoderConfig":
        rates = (cfg.get("input_sampling_rate"), cfg.get("input_hop_length"),
                 cfg.get("output_sampling_rate"), cfg.get("output_hop_length"))
        if rates != (24000, 960, contract.SAMPLE_RATE, contract.LATENT_HOP):
            raise CheckpointError(f"condition_encoder rates {rates} differ from the checkpoint contract")
        return cls(
            hidden=require(cfg, "condition_hidden_dim"),
            streams=require(cfg, "num_condition_layers"),
            out_dim=require(cfg, "out_dim"),
        )


class ConditionEncoder(nn.Module):
    def __init__(self, cfg: ConditionEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.stream_logits = nn.Parameter(torch.zeros(cfg.streams))
        self.scale = nn.Parameter(torch.ones(1))
        self.proj = nn.Conv1d(cfg.hidden, cfg.out_dim, kernel_size=3, padding=1)

    def mix(self, frames: torch.Tensor) -> torch.Tensor:
        """[..., streams * hidden] frame conditioning -> [..., hidden], weighted by softmax(logits) * scale."""
        if frames.shape[-1] != self.cfg.streams * self.cfg.hidden:
            raise ValueError(f"frame conditioning is {self.cfg.streams} streams of {self.cfg.hidden}, "
                             f"{self.cfg.streams * self.cfg.hidden} wide; got {frames.shape[-1]}")
        return mix_streams(frames, torch.softmax(self.stream_logits, dim=0), self.scale)

    def project(self, mixed: torch.Tensor) -> torch.Tensor:
        """Mixed frames [batch, frames, hidden] of one window -> condition [batch, latent_len, out_dim]."""
        x = self.proj(mixed.transpose(1, 2).to(self.proj.weight.dtype))
        x = F.interpolate(x, size=contract.latent_length(mixed.shape[1]), mode="nearest")
        return x.transpose(1, 2)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.project(self.mix(frames))

    @staticmethod
    def checkpoint_sources(cfg: ConditionEncoderConfig) -> dict[str, list[Source]]:
        return {
            "stream_logits": [Source("layer_weight_logits", (cfg.streams,))],
            "scale": [Source("layer_scale", (1,))],
            "proj.weight": [Source("proj.weight", (cfg.out_dim, cfg.hidden, 3))],
            "proj.bias": [Source("proj.bias", (cfg.out_dim,))],
        }


@hot
def mix_streams(frames: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """ConditionEncoder.mix's sum as a hot path, the streams weighted and added one after the other: compiled, one
    elementwise kernel whose arithmetic per frame is the same in every compiled shape, whatever the number of frames
    mixed together (the talker mixes one frame a song). A reduction kernel's order follows its launch configuration,
    which inductor picks per compiled shape; so the weights' softmax runs before, uncompiled. The streams are slices:
    a reshape's strides would be guarded on the frame count being one (a second graph for a lone song's frame)."""
    weights = weights.to(frames.dtype)
    width = frames.shape[-1] // weights.shape[0]
    streams = [frames[..., i * width : (i + 1) * width] for i in range(weights.shape[0])]
    mixed = streams[0] * weights[0]
    for stream, weight in zip(streams[1:], weights[1:]):
        mixed = mixed + stream * weight
    return scale.to(frames.dtype) * mixed
