"""What a caller sends the engine (SongRequest) and the events it streams back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import contract


@dataclass
class SongRequest:
    caption: str
    lyrics: str
    duration_s: float = 30.0
    seed: int | None = None
    steps: int = contract.DIT_STEPS
    id: str | None = None


@dataclass
class Accepted:
    song: str
    seed: int
    budget_frames: int
    prompt_tokens: int


@dataclass
class AudioChunk:
    song: str
    window: int
    pcm: np.ndarray  # [2, samples] float32 at 44.1 kHz, in [-1, 1]
    last: bool


@dataclass
class Done:
    song: str
    frames: int
    ended_by: str
    timings: dict[str, float]


@dataclass
class Failed:
    song: str
    message: str
    refused: bool = False  # the request was refused as invalid before acceptance (the caller's fault: HTTP 400)


Event = Accepted | AudioChunk | Done | Failed


class SongProgress(NamedTuple):
    """A held song's frames written by the talker, windows rendered by stage 1, and whether it still waits in the
    talker's queue (no rows yet)."""

    frames: int
    windows: int
    queued: bool
