"""What the stages report about the songs an engine holds, turned into their callers' events: a song accepted or
refused, a window rendered (an AudioChunk, or held until the last with codec_streaming off), a song done or failed."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..acoustic.payloads import RenderedWindow
from ..talker.events import SongFinished
from .events import Accepted, AudioChunk, Done, Failed
from .held_songs import HeldSongs, SongClient, callers_ids
from .metrics import EngineMetrics
from .talker_loop import Callers


class StageReports:
    """The callbacks the talker loop (`callers`) and stage 1 (`on_chunk`, `fail_and_cancel`) call from their
    threads, told to the songs held in `held`."""

    def __init__(self, held: HeldSongs, codec_streaming: bool, metrics: EngineMetrics, cancel: Callable[[str], None]):
        """codec_streaming: whether a song's audio goes out window by window (else whole, at its end); cancel(key):
        stop a song's work in both stages."""
        self.held, self.codec_streaming, self.metrics, self.cancel = held, codec_streaming, metrics, cancel

    def callers(self) -> Callers:
        return Callers(live=self.held.live, accepted=self.accepted, refused=self.refused, finished=self.finished,
                       fail=self.fail)

    def accepted(self, key: str, seed: int, budget: int, prompt_tokens: int) -> None:
        client = self.held.client(key)
        if client is not None:
            client.accepted = True
        self.held.emit(key, Accepted, seed, budget, prompt_tokens)

    def refused(self, key: str, message: str) -> None:
        if self.held.end(key) is not None:  # ends once: a cancel now is too late, and counts nothing
            self.held.emit(key, Failed, message, True)

    def finished(self, event: SongFinished) -> None:
        client = self.held.client(event.song)
        if client:
            client.finished = event

    def fail_and_cancel(self, key: str, message: str) -> None:
        """A song stage 1 cannot finish (its render failed, its audio was lost or late): it fails and is cancelled."""
        self.fail(key, message)
        self.cancel(key)  # stops its talker rows and drops its later windows

    def on_chunk(self, out: RenderedWindow) -> None:
        self.metrics.windows.inc()
        now = time.perf_counter()
        client = self.held.client(out.song)
        if client is None or client.ended:
            return
        client.windows += 1
        if not self.codec_streaming:  # the client gets the song in one piece at the end
            client.held_pcm.append(out.pcm.numpy())
            if not out.window.last:
                return
        if client.first_audio is None:
            client.first_audio = now
            self.metrics.first_audio.observe(now - client.submitted)
        if client.held_pcm:
            self.held.emit(out.song, AudioChunk, 0, np.concatenate(client.held_pcm, axis=-1), True)
        else:
            self.held.emit(out.song, AudioChunk, out.window.index, out.pcm.numpy(), out.window.last)
        if out.window.last:
            self._done(out.song, client, now)

    def _done(self, key: str, client: SongClient, now: float) -> None:
        # The talker emits a song's last window in the step that emits its SongFinished, and TalkerLoop._hand_on takes
        # that first: `finished` was set before the window was handed on. Checked before the song ends, so that a
        # breach fails it.
        finished = client.finished
        assert finished is not None, f"{key}: its last window came before its SongFinished"
        if self.held.end(key) is None:  # cancelled or failed since its last window was taken
            return
        timings = {"first_audio_s": client.first_audio - client.submitted, "total_s": now - client.submitted}
        client.done_s = timings["total_s"]  # counted as the stream closes, unless its caller fails it first
        self.held.emit(key, Done, finished.frames, finished.ended_by, timings)

    def fail(self, key: str, message: str) -> bool:
        """Fail a held submission (counted once, however many stages report it); whether this call ended it."""
        if self.held.end(key) is None:
            return False
        self.metrics.failures.inc()
        self.held.emit(key, Failed, callers_ids(message))
        return True

    def fail_done(self, key: str) -> bool:
        """Count as failed, not done, a song whose Done is out but whose caller could not deliver it (say the server
        could not encode its last piece); whether it did (once)."""
        client = self.held.client(key)
        if client is None or client.done_s is None:
            return False
        client.done_s = None
        self.metrics.failures.inc()
        return True

    def fail_all(self, message: str) -> None:
        """Fail every song held (the engine stops serving)."""
        for key in self.held.held_keys():
            self.fail(key, message)
