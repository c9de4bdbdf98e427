"""Window geometry of stage 1: which frames a window covers, its latent length, overlap and crops."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import contract


@dataclass(frozen=True)
class Window:
    index: int
    start: int  # first frame
    frames: int
    last: bool

    @property
    def latent_length(self) -> int:
        return contract.latent_length(self.frames)

    @property
    def crop(self) -> tuple[int, int]:
        """Waveform samples dropped on the left and right of this window's vocoder output."""
        left = 0 if self.index == 0 else contract.CROP_LEFT_LATENT * contract.LATENT_HOP
        right = 0 if self.last else contract.CROP_RIGHT_LATENT * contract.LATENT_HOP
        return left, right

    @property
    def samples(self) -> int:
        """Waveform samples this window adds to its song (its vocoder output less the crops)."""
        left, right = self.crop
        return self.latent_length * contract.LATENT_HOP - left - right


def song_windows(frames: int) -> list[Window]:
    """The windows of a song of `frames` frames, in order."""
    starts = contract.window_starts(frames)
    return [
        Window(i, s, contract.window_frames(frames, s), last=i == len(starts) - 1) for i, s in enumerate(starts)
    ]


def is_song_window(window: Window) -> bool:
    """Whether `window` is one that song_windows gives for some song: full unless it is the last, and a last one as
    its song's length lays it out (past window 0, more than 100 frames)."""
    if window.index < 0 or window.frames < 1 or window.start != window.index * contract.WINDOW_HOP:
        return False
    if window.last:
        return song_windows(window.start + window.frames)[-1] == window
    return window.frames == contract.WINDOW_FRAMES


def carry_span(latent_length: int) -> tuple[int, int]:
    """Latent columns [start, end) handed to the next window as its overlap prompt."""
    start = max(0, latent_length - 2 * contract.OVERLAP_LATENT)
    return start, max(start, latent_length - contract.OVERLAP_LATENT)


def crop_waveform(waveform: torch.Tensor, window: Window) -> torch.Tensor:
    """The part of a window's waveform [..., samples] that belongs to the song."""
    left, right = window.crop
    return waveform[..., left : waveform.shape[-1] - right]


def song_samples(frames: int) -> int:
    """Waveform samples of a whole song at the vocoder rate."""
    return sum(window.samples for window in song_windows(frames))
