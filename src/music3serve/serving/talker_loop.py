"""Stage 0's thread in the engine: it takes songs and cancels from the engine, steps the talker while any song is
decoding, and hands each step's events on: windows to stage 1, the rest to the songs' callers (through `Callers`)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Callable, NamedTuple

import torch

from ..acoustic.payloads import WindowPayload
from ..errors import InputError, Music3Error, error_text
from ..talker.engine import Talker
from ..talker.events import Event, SongFailed, SongFinished, WindowReady
from .heartbeat import StageWatch
from .metrics import EngineMetrics
from .render_loop import FAILED_CALLS_BEFORE_STOP
from .stage1 import Stage1

log = logging.getLogger(__name__)


class Callers(NamedTuple):
    """The engine's side, by song key: what its callers hold and are told."""

    live: Callable[[str], bool]  # held by a caller and not ended (done, failed or cancelled)
    accepted: Callable[[str, int, int, int], None]  # (key, seed, frame budget, prompt tokens)
    refused: Callable[[str, str], None]  # (key, message): bad input the talker refused; served and failed neither
    finished: Callable[[SongFinished], None]  # the song's last frame is written; its last window is in the same step
    fail: Callable[[str, str], None]  # (key, message): the song failed, counted once


class TalkerLoop:
    """`run` is the thread's body, until `stop` is set; `submit` and `cancel` (from any thread) take effect between
    steps."""

    def __init__(self, talker: Talker, callers: Callers, stage1: Stage1, watch: StageWatch, metrics: EngineMetrics,
                 stop: threading.Event, async_chunk: bool):
        """async_chunk false: a song's windows are held here until its last frame, then sent on together."""
        self.talker, self.callers, self.stage1, self.watch, self.metrics = talker, callers, stage1, watch, metrics
        self.stop, self.async_chunk = stop, async_chunk
        self._control: queue.Queue = queue.Queue()  # ("submit", *arguments of _take) | ("cancel", key) | ("wake",)
        self.steps: dict[str, int] = {}  # each song's Euler steps, for its windows' payloads
        # async_chunk false: each song's windows, waiting here for its last frame
        self.held_windows: dict[str, list[tuple[WindowPayload, torch.cuda.Event | None]]] = {}

    def submit(self, key: str, cond: list[int], uncond: list[int], seed: int, requested: int, steps: int) -> None:
        """Queue a song: it is accepted with its frame budget, refused or failed (told to the callers)."""
        self._control.put(("submit", key, cond, uncond, seed, requested, steps))

    def cancel(self, key: str) -> None:
        self._control.put(("cancel", key))

    def wake(self) -> None:
        """End a wait for work at once (closing: `stop` is set)."""
        self._control.put(("wake",))

    def run(self) -> None:
        stream = self.talker.stream  # the talker's own high-priority stream (its graphs were captured on it)
        failures_in_a_row = 0
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            while not self.stop.is_set():
                self.watch.busy(None)  # waiting for work is no call
                self._drain_control(block=not self.talker.busy)
                if not self.talker.busy:
                    continue
                written = self.talker.frames_written
                self.watch.busy(1.0)  # the step, and the hand-over of its windows (split: their copy to the host)
                try:
                    events = self.talker.step()
                except Exception as exc:  # a failed step fails its songs, never the engine nor the queue
                    log.exception("talker step failed")
                    # The songs decoding; a step that fails with none (say the device is gone) fails the queue too,
                    # which would otherwise meet the same failure at every step, forever.
                    for song in [s.id for s in self.talker.active] or list(self.talker.songs):
                        self._drop(song)  # its windows held here or sent on to stage 1 too
                        self.callers.fail(song, f"stage 0 failed: {error_text(exc)}")
                    failures_in_a_row += 1
                    if failures_in_a_row >= FAILED_CALLS_BEFORE_STOP:
                        raise Music3Error(f"stage 0 failed {failures_in_a_row} steps in a row (the last: "
                                          f"{error_text(exc)}); "
                                          "it stops") from exc
                    continue
                finally:
                    self.metrics.frames.inc(self.talker.frames_written - written)
                failures_in_a_row = 0
                self.metrics.talker_steps.inc()
                self._hand_on(events)
            self.talker.cancel_all()  # closing: songs cut mid-stream give back their rows and buffers now

    def _hand_on(self, events: list[Event]) -> None:
        """A step's events to the songs' callers and their windows to stage 1 (held until the song's last frame with
        async_chunk false)."""
        for event in sorted(events, key=lambda e: not isinstance(e, SongFinished)):
            if isinstance(event, SongFinished):
                self.callers.finished(event)
            # A window of a song that ended meanwhile is dropped here (not held), and would not be sent on anyway.
            elif isinstance(event, WindowReady) and self.callers.live(event.song):
                payload = WindowPayload(event.song, event.seed, event.window, event.mixed, self.steps[event.song])
                if self.async_chunk:
                    self._to_stage1(payload, event.ready)
                else:
                    self.held_windows.setdefault(event.song, []).append((payload, event.ready))
            elif isinstance(event, SongFailed):
                self.callers.fail(event.song, event.message)
        for event in events:
            if isinstance(event, (SongFinished, SongFailed)):
                self.steps.pop(event.song, None)
                windows = self.held_windows.pop(event.song, [])
                if isinstance(event, SongFinished):  # async_chunk false: now all of them, in order
                    for payload, ready in windows:
                        self._to_stage1(payload, ready)

    def _to_stage1(self, payload: WindowPayload, ready: torch.cuda.Event | None) -> None:
        if self.callers.live(payload.song):  # else cancelled or failed meanwhile (say an earlier window was not sent)
            self.stage1.send(payload, ready)

    def _drain_control(self, block: bool) -> None:
        try:
            item = self._control.get(timeout=0.05) if block else self._control.get_nowait()
        except queue.Empty:
            return
        while True:
            if item[0] == "submit":
                self._take(*item[1:])
            elif item[0] == "cancel":
                self._drop(item[1])
            try:
                item = self._control.get_nowait()
            except queue.Empty:
                return

    def _take(self, song: str, cond: list[int], uncond: list[int], seed: int, requested: int, steps: int) -> None:
        if not self.callers.live(song):  # its caller is gone: cancelled (that cancel may have come first) or left
            return
        try:
            self.watch.busy(1.0)  # taking a song copies its prompt to the device, behind the step in flight
            budget = self.talker.submit(song, cond, uncond, seed, requested)
        except InputError as exc:  # a refused request (HTTP 400): neither a request nor a failure served
            self.metrics.refusals.labels("invalid").inc()
            self.callers.refused(song, str(exc))
        except Exception as exc:  # say a device error while queueing it: this song fails, the engine goes on
            log.exception("stage 0 could not take a song", extra={"song": song})
            self.talker.cancel(song)  # whatever part of it was queued
            self.callers.fail(song, f"stage 0 could not take the song: {error_text(exc)}")
        else:
            self.steps[song] = steps
            self.metrics.requests.inc()
            self.callers.accepted(song, seed, budget, len(cond))
        finally:
            self.watch.busy(None)

    def _drop(self, song: str) -> None:
        """Stop a song in both stages and forget what this loop keeps of it."""
        self.talker.cancel(song)
        self.steps.pop(song, None)
        self.held_windows.pop(song, None)
        self.stage1.cancel(song)
