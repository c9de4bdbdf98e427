"""What a talker step hands out: a window ready for stage 1, a song finished with its codes, or a song failed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..acoustic.windows import Window


@dataclass
class WindowReady:
    song: str
    seed: int
    window: Window
    mixed: torch.Tensor  # [frames, hidden] float32: frame conditioning mixed by the condition encoder's weights
    ready: torch.cuda.Event | None = None  # on CUDA: recorded once `mixed` is written (another stream waits on it)


@dataclass
class SongFinished:
    song: str
    frames: int
    ended_by: str  # "audio_end" or "budget"
    codes: torch.Tensor  # [frames, 8]


@dataclass
class SongFailed:
    song: str
    message: str


Event = WindowReady | SongFinished | SongFailed
