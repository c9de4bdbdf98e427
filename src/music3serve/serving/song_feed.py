"""One song's engine events as the HTTP API reads them (stopped at once by a DELETE or a client gone), and its
audio as it is fed to the encoder."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import numpy as np

from .. import contract
from .audio_io import CHANNELS
from .events import Event, Failed

SILENCE = np.zeros((CHANNELS, 0), np.float32)  # what a Done feeds the encoder: nothing more, the end of the audio


# A window goes to its encoder in slices this long, each sent once encoded: a song's first audio leaves after one
# slice's encoding, not its whole first window's (MP3 takes ~25-45 ms of CPU per second of audio). The song's very first
# slice is shorter still, the shortest after which every format has decodable audio out (tests/test_encoders.py).
FEED_SAMPLES = contract.SAMPLE_RATE // 2
FIRST_FEED_SAMPLES = contract.SAMPLE_RATE // 4


def window_slices(pcm: np.ndarray, last: bool, first: bool = False) -> list[tuple[np.ndarray, bool]]:
    """A window's PCM as the encoder is fed it: FEED_SAMPLES at a time (first: the song's first window, whose first
    slice is FIRST_FEED_SAMPLES), `last` on the final slice only."""
    head = FIRST_FEED_SAMPLES if first else 0
    starts = [*([0] if head else []), *range(head, pcm.shape[-1], FEED_SAMPLES)] or [0]
    ends = [*starts[1:], pcm.shape[-1]]
    return [(pcm[..., s:e], last and e >= pcm.shape[-1]) for s, e in zip(starts, ends)]


async def _pull(events: AsyncIterator[Event]) -> Event:
    try:
        return await anext(events)
    except StopAsyncIteration:  # not an exception a task may carry
        return Failed("", "the engine ended the song without a Done or Failed event")


async def next_event(events: AsyncIterator[Event], stop: asyncio.Event) -> Event | None:
    """The song's next event, or None once `stop` is set (DELETE or a client gone); then the engine generator
    is closed, which cancels the song in the engine."""
    if stop.is_set():
        return None
    step, halt = asyncio.ensure_future(_pull(events)), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({step, halt}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.cancel()
        if not step.done():
            step.cancel()  # raises CancelledError inside the engine generator: its finally cancels the song
            await asyncio.wait({step})
    return None if step.cancelled() else step.result()
