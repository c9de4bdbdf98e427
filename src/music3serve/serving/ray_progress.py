"""A song's events on its engine replica, with its progress (Engine.progress) beside them: the front's GET reports
frames written and windows rendered without a call to the replica (serving/ray_front.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from .engine import Engine
from .events import Accepted, Event

PROGRESS_EVERY_S = 0.5  # a running song's progress is sent this often while it changes (and with every window)


@dataclass(frozen=True)
class Progress:
    """A running song's progress on its replica (Engine.progress), sent beside its events."""

    frames: int
    windows: int
    queued: bool


async def _pull(events: AsyncIterator[Event]) -> Event | None:
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None


async def with_progress(engine: Engine, events: AsyncIterator[Event]) -> AsyncIterator[Event | Progress]:
    """A song's events, each preceded by its Progress where that changed, and a Progress every PROGRESS_EVERY_S
    between events while it changes. Closing this cancels the song (its engine stream is cancelled)."""
    song, sent, step = None, None, None
    try:
        while True:
            step = step or asyncio.ensure_future(_pull(events))
            done, _ = await asyncio.wait({step}, timeout=PROGRESS_EVERY_S)
            event = step.result() if done else None  # the engine's refusal raises here
            step = None if done else step
            progress = engine.progress(song) if song is not None else None
            if progress is not None and progress != sent:
                sent = progress
                yield Progress(*progress)
            if done and event is None:  # the engine's stream ended
                return
            if event is not None:
                song = event.song if isinstance(event, Accepted) else song
                yield event
    finally:
        if step is not None and not step.done():
            step.cancel()  # raises CancelledError inside the engine's stream: it cancels the song
            await asyncio.wait({step})
