"""The songs of the HTTP API by their engine ids: those running, those waiting for the engine to accept them, and the
last KEEP_FINISHED finished ones for GET /v1/songs/{id}; a song's end is recorded (and logged) once."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from ..errors import public_text
from .engine import Engine
from .events import Done, Failed
from .song_types import SongState

log = logging.getLogger("music3serve.serving.song_service")  # the songs' lines, under the name users filter on

KEEP_FINISHED = 1024  # outcomes of finished songs kept for GET /v1/songs/{id}


class SongRegistry:
    """The songs' states, and their cancels as the client's leaving or a DELETE asks (SongService keeps one)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.running: dict[str, SongState] = {}
        self.pending: dict[str, asyncio.Event] = {}  # client-given ids still waiting for acceptance
        self.finished: OrderedDict[str, SongState] = OrderedDict()

    def lookup(self, name: str) -> SongState | None:
        """A running or recently finished song by its engine id (`scoped`)."""
        return self.running.get(name) or self.finished.get(name)

    def finish(self, song: SongState, state: str, error: str | None = None) -> None:
        if song.state == "running":
            song.state, song.error = state, error
            log.info("song ended", extra={"song": song.name, "state": song.state, "seed": song.seed,
                                          "frames": song.frames, "ended_by": song.ended_by,
                                          "samples": song.samples_sent, "error": song.error})
        if self.running.get(song.name) is song:  # not a newer song that reused the id after this one ended
            del self.running[song.name]
        if self.finished.get(song.name) is not song:  # a reused id's newest result goes to the back of the line
            self.finished.pop(song.name, None)
            self.finished[song.name] = song
        while len(self.finished) > KEEP_FINISHED:
            self.finished.popitem(last=False)

    def refresh(self, song: SongState) -> None:
        """A running song's frames written, windows rendered and place in the queue, brought up to the engine's."""
        progress = self.engine.progress(song.name) if song.state == "running" else None
        if progress is not None:
            song.frames_written, song.windows_rendered = max(song.frames_written, progress.frames), progress.windows
            song.queued = song.queued and progress.queued  # once it has rows, never queued again

    def client_gone(self, song: SongState) -> None:
        """The client left: its song is cancelled as by a DELETE; a song the engine has already ended keeps that
        end (done or failed, as the metrics count it), not delivered."""
        if song.state == "running" and not song.stop.is_set() and self.engine.cancel(song.name):
            song.stop.set()

    def cancel(self, name: str) -> None:
        """DELETE: end the song's response and its work in the engine; a song the engine has already ended goes on
        to its end (its last audio, or its failure, is on its way to the client)."""
        song, cancelled = self.running.get(name), self.engine.cancel(name)
        stop = self.pending.get(name) if song is None else song.stop if cancelled else None
        if stop is not None:
            stop.set()  # ends the client's response (before the engine's Failed("cancelled") reaches it)

    def failed(self, song: SongState, exc: Exception) -> None:
        """The server could not go on with a running song (say its encoder raised): the song fails here and in the
        engine, counted as a failure (not a cancel), and the traceback is logged."""
        text, reference = public_text(exc)
        log.error("song failed in the server", exc_info=exc, extra={"song": song.name, "reference": reference})
        message = f"the server failed: {text}"
        if song.state == "running":
            self.engine.fail(song.name, message)
        self.finish(song, "failed", message)

    def ended(self, song: SongState, event: Done | Failed) -> None:
        if isinstance(event, Done):
            self.refresh(song)
            song.frames = song.frames_written = event.frames
            song.ended_by, song.timings = event.ended_by, event.timings
            song.first_audio_s = event.timings.get("first_audio_s")
            self.finish(song, "done")
        else:
            log.error("song failed", extra={"song": song.name, "error": event.message, "samples": song.samples_sent})
            self.finish(song, "failed", event.message)
