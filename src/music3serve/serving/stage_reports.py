"""What the stages report about the songs an engine holds, turned into their callers' events: a song accepted or
refused, a window rendered (an AudioChunk, or held until the last with codec_streaming off), a song done or failed."""

from __future__ import annotations

import time

import numpy as np

from ..acoustic.renderer import RenderedWindow
from ..talker.engine import SongFinished
from .deploy_schema import DeployConfig
from .events import Accepted, AudioChunk, Done, Failed
from .held_songs import HeldSongs, SongClient, callers_ids


class StageReports(HeldSongs):
    """The callbacks the talker loop and stage 1 call from their threads (a mixin of Engine)."""

    deploy: DeployConfig

    def _live(self, key: str) -> bool:
        client = self._clients.get(key)
        return client is not None and not client.ended

    def _accepted(self, key: str, seed: int, budget: int, prompt_tokens: int) -> None:
        self._emit(key, Accepted, seed, budget, prompt_tokens)

    def _refused(self, key: str, message: str) -> None:
        if self._end(key) is not None:  # ends once: a cancel now is too late, and counts nothing
            self._emit(key, Failed, message, True)

    def _finished(self, event: SongFinished) -> None:
        client = self._clients.get(event.song)
        if client:
            client.finished = event

    def _fail_and_cancel(self, key: str, message: str) -> None:
        """A song stage 1 cannot finish (its render failed, its audio was lost or late): it fails and is cancelled."""
        self._fail(key, message)
        self._cancel(key)  # stops its talker rows and drops its later windows

    def _on_chunk(self, out: RenderedWindow) -> None:
        self.metrics.windows.inc()
        now = time.perf_counter()
        client = self._clients.get(out.song)
        if client is None or client.ended:
            return
        client.windows += 1
        if not self.deploy.connector.extra.codec_streaming:  # the client gets the song in one piece at the end
            client.held_pcm.append(out.pcm.numpy())
            if not out.window.last:
                return
        if client.first_audio is None:
            client.first_audio = now
            self.metrics.first_audio.observe(now - client.submitted)
        if client.held_pcm:
            self._emit(out.song, AudioChunk, 0, np.concatenate(client.held_pcm, axis=-1), True)
        else:
            self._emit(out.song, AudioChunk, out.window.index, out.pcm.numpy(), out.window.last)
        if out.window.last:
            self._done(out.song, client, now)

    def _done(self, key: str, client: SongClient, now: float) -> None:
        # The talker emits a song's last window in the step that emits its SongFinished, and TalkerLoop._hand_on takes
        # that first: `finished` was set before the window was handed on. Checked before the song ends, so that a
        # breach fails it.
        finished = client.finished
        assert finished is not None, f"{key}: its last window came before its SongFinished"
        if self._end(key) is None:  # cancelled or failed since its last window was taken
            return
        timings = {"first_audio_s": client.first_audio - client.submitted, "total_s": now - client.submitted}
        self.metrics.song_seconds.observe(timings["total_s"])
        self._emit(key, Done, finished.frames, finished.ended_by, timings)

    def _fail(self, key: str, message: str) -> None:
        """Fail a held submission (counted once, however many stages report it)."""
        if self._end(key) is None:
            return
        self.metrics.failures.inc()
        self._emit(key, Failed, callers_ids(message))
