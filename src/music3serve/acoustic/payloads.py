"""What a render call takes (WindowPayload) and gives back (RenderedWindow), the checks its payloads pass, and what
the renderer keeps of a streaming song between two of its windows."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .. import contract
from .solver import Carry
from .windows import Window, carry_span, is_song_window


@dataclass(frozen=True)
class WindowPayload:
    """One window that the talker has finished: its frames' conditioning, mixed over the 8 streams.

    Window i (frames 100 i ..) is not the last once the song has more than 100 i + 200 frames; at the song's end the
    remaining window goes out with last=True and as many frames as there are (see windows.song_windows)."""

    song: Hashable
    seed: int
    window: Window
    mixed: torch.Tensor  # [window.frames, hidden], ConditionEncoder.mix of the talker's frame conditioning
    steps: int = contract.DIT_STEPS


@dataclass
class RenderedWindow:
    song: Hashable
    window: Window
    pcm: torch.Tensor  # [2, samples] float32 on the CPU, cropped and clamped to [-1, 1]
    latent: torch.Tensor  # [channels, latent_length] float32 on the CPU


@dataclass
class StreamedSong:
    """A song the renderer is streaming: its seed, the window it needs next and the carry that window takes."""

    seed: int
    next_index: int
    carry: Carry


def check_payloads(payloads: list[WindowPayload], songs: dict[Hashable, StreamedSong], hidden: int) -> None:
    """Refuse a render call whose payloads are not each a song's next window, with its seed, shape and steps."""
    seen: set[Hashable] = set()
    for p in payloads:
        w, name = p.window, f"song {p.song!r}"
        if p.song in seen:
            raise ValueError(f"{name} has two windows in one render call; send its windows one call after another")
        seen.add(p.song)
        state = songs.get(p.song)
        expected = 0 if state is None else state.next_index
        if w.index != expected:
            raise ValueError(f"{name}: window {w.index} arrived out of order, window {expected} is next"
                             + (" (the renderer holds no state for this song)" if state is None else ""))
        if not contract.is_seed(p.seed):
            raise ValueError(f"{name}: seed must be an integer in [0, 2**64), got {p.seed!r}")
        if state is not None and p.seed != state.seed:
            raise ValueError(f"{name}: seed {p.seed} differs from the seed {state.seed} of its earlier windows")
        if not is_song_window(w):
            raise ValueError(f"{name}: {w} is not a window of the contract geometry")
        if tuple(p.mixed.shape) != (w.frames, hidden):
            raise ValueError(f"{name}: mixed conditioning is {tuple(p.mixed.shape)}, "
                             f"expected ({w.frames}, {hidden})")
        if isinstance(p.steps, bool) or not isinstance(p.steps, int) or p.steps < 1:
            raise ValueError(f"{name}: steps must be a positive integer, got {p.steps!r}")


def next_state(payload: WindowPayload, latent: torch.Tensor, condition: torch.Tensor) -> StreamedSong | None:
    """The song's state after this window: the carry for its next one, None after its last."""
    if payload.window.last:
        return None
    start, end = carry_span(latent.shape[-1])
    carry = Carry(latent[:, start:end].clone(), condition[start:end].clone())
    return StreamedSong(payload.seed, payload.window.index + 1, carry)
