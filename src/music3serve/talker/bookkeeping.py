"""The talker's records: each song it holds, from the checks at submission to its last frame, and the frame step
queued on the device whose results the host has not read yet."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import contract
from ..acoustic.windows import Window
from ..errors import InputError
from .events import WindowReady
from .windows import WindowTracker


@dataclass
class InFlightStep:
    """A frame step queued on the device whose results the host has not read yet."""

    songs: list["TalkerSong"]  # the song in each pair when the step was queued
    buffer: int  # which of the two pinned host buffers its codes and audio_end flags are copied to
    copied: torch.cuda.Event | None  # recorded after its results and conditioning copies (None on the CPU)


@dataclass
class TalkerSong:
    id: str
    seed: int
    ids: torch.Tensor  # [2, prompt tokens]: cond and uncond rows
    budget: int
    pair: int | None = None
    prefilled: int = 0
    steps: int = 0  # frame steps whose results were read back; step 0's frame is not emitted
    launched: int = 0  # frame steps queued on the device (one more than `steps` while a step is in flight)
    codes: list[torch.Tensor] = field(default_factory=list)
    # [budget + 1, hidden] on the device: the spare row takes the step already queued when the song ends
    conditioning: torch.Tensor | None = None
    windows: WindowTracker = field(default_factory=WindowTracker)

    @property
    def frames(self) -> int:
        return len(self.codes)

    def window_ready(self, window: Window, ready: torch.cuda.Event | None) -> WindowReady:
        mixed = self.conditioning[window.start : window.start + window.frames]
        return WindowReady(self.id, self.seed, window, mixed, ready)


def new_song(song: str, cond_ids: list[int], uncond_ids: list[int], seed: int, requested_frames: int, vocab: int,
             max_model_len: int, device: torch.device) -> TalkerSong:
    """A song whose prompts and frame count passed the checks, with its frame budget and its prompts on the device."""
    if len(cond_ids) != len(uncond_ids) or not cond_ids:
        raise InputError("cond and uncond prompts must be non-empty and of the same length")
    if not all(0 <= i < vocab for i in (*cond_ids, *uncond_ids)):  # on CUDA: a device assert
        raise InputError(f"prompt token ids must lie in [0, {vocab}) of the language model's vocabulary")
    if requested_frames < 1:
        raise InputError(f"a song needs at least one frame, got {requested_frames} requested")
    room = max_model_len - len(cond_ids)
    if room < 1:
        raise InputError(
            f"the prompt has {len(cond_ids)} tokens and leaves no frames within max_model_len {max_model_len}"
        )
    budget = contract.frame_budget(requested_frames, len(cond_ids), max_model_len)
    ids = torch.tensor([cond_ids, uncond_ids], dtype=torch.int64, device=device)
    return TalkerSong(song, seed, ids, budget)
