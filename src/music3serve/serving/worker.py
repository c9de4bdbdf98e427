"""The engine's side of stage 1 in its own process (the split placement): starting the worker, sending it windows
and cancels through the configured connector, and reading its PCM within each song's deadlines."""

from __future__ import annotations

import atexit
import multiprocessing
import threading
import time
from typing import Any, Callable

import torch

from .. import contract
from ..acoustic.payloads import WindowPayload
from ..errors import Music3Error
from .connectors import ConnectorTimeout, Message, make_connector
from .deploy_config import ConnectorConfig, Stage1Config
from .heartbeat import RENDER_LIMIT_PER_WINDOW_S, WorkerWatch, hang_limit
from .outbox import Outbox
from .worker_messages import PCM, WINDOWS, window_message
from .worker_process import worker_main

STARTUP_TIMEOUT_S = 1800.0  # loading 10 GB of acoustic weights and capturing graphs
# Windows written to the worker and not yet read by it: at least 12 (~40 MB of /dev/shm; Docker's default is 64 MB),
# and a render batch and some more; others wait in the engine's memory while the worker renders.
WINDOWS_IN_FLIGHT = 12


def windows_in_flight(render_batch: int) -> int:
    return max(WINDOWS_IN_FLIGHT, render_batch + 4)


class ChunkDeadlines:
    """The connector's waits per song: a window sent is answered within the wait (longer for a song's first),
    and while the worker sends audio or says it is rendering, every waiting song's clock restarts (it is queued
    behind work in progress, not lost; a render that never ends is the worker watch's to catch). A song
    asking for more Euler steps than the contract's 30 gets waits that many times longer (its render takes that
    much longer), and while it has windows out every other song's waits stretch as much (they may be batched with
    it, or queued behind its render call)."""

    def __init__(self, first_chunk_s: float, later_s: float):
        self.first_chunk_s, self.later_s = first_chunk_s, later_s
        # windows out, deadline, answered before, wait scale
        self.songs: dict[str, tuple[int, float | None, bool, float]] = {}
        self.lock = threading.Lock()

    def _wait(self, answered: bool, scale: float) -> float:
        heaviest = max((s for _, deadline, _, s in self.songs.values() if deadline is not None), default=1.0)
        return (self.later_s if answered else self.first_chunk_s) * max(scale, heaviest)

    def sent(self, song: str, steps: int = contract.DIT_STEPS) -> None:
        with self.lock:
            outstanding, deadline, answered, scale = self.songs.get(song, (0, None, False, 1.0))
            scale = max(scale, steps / contract.DIT_STEPS, 1.0)
            if deadline is None:
                deadline = time.monotonic() + self._wait(answered, scale)
            self.songs[song] = (outstanding + 1, deadline, answered, scale)
            if scale > 1.0:
                self._restart(time.monotonic())  # the others may wait behind this song's render now

    def restart(self) -> None:
        """Every waiting song's clock restarts now (the worker is in a render call, or this process was paused)."""
        with self.lock:
            self._restart(time.monotonic())

    def _restart(self, now: float) -> None:
        """Every waiting song's clock from `now` (never shortened)."""
        for other, (count, deadline, before, scale) in self.songs.items():
            if deadline is not None:
                self.songs[other] = (count, max(deadline, now + self._wait(before, scale)), before, scale)

    def answered(self, song: str, last: bool) -> None:
        with self.lock:
            now = time.monotonic()
            self._restart(now)
            if song not in self.songs:
                return  # cancelled or failed meanwhile
            outstanding, _, _, scale = self.songs[song]
            outstanding -= 1
            if last:
                del self.songs[song]
            elif outstanding <= 0:
                self.songs[song] = (0, None, True, scale)  # nothing due until the next window goes out
            else:
                self.songs[song] = (outstanding, now + self._wait(True, scale), True, scale)

    def overdue(self) -> list[str]:
        """Songs past their deadline (forgotten here: the caller fails them)."""
        now = time.monotonic()
        with self.lock:
            late = [song for song, (_, deadline, _, _) in self.songs.items() if deadline is not None and now > deadline]
            for song in late:
                del self.songs[song]
        return late

    def drop(self, song: str) -> None:
        with self.lock:
            self.songs.pop(song, None)


class RenderWorker:
    """Starts the worker process and carries windows to it and PCM back. `load(device)` runs in the worker and
    returns its models (a module-level function or partial, as the process is spawned): worker_process.py's
    load_acoustic for a checkpoint."""

    def __init__(self, load: Callable[[str], Any], device: str, stage1: Stage1Config, connector: ConnectorConfig):
        extra = connector.extra
        self.deadlines = ChunkDeadlines(extra.first_chunk_timeout_s, extra.timeout_s)
        self.connector = make_connector(connector.name, extra, channels=(WINDOWS, PCM))
        context = multiprocessing.get_context("spawn")
        slots = context.Semaphore(windows_in_flight(stage1.render_batch))
        self.process = context.Process(
            target=worker_main, args=(load, device, stage1, self.connector, slots), name="music3-stage1", daemon=True
        )
        self.process.start()
        self.outbox = Outbox(self.connector, WINDOWS, slots)
        self.watch = WorkerWatch(render_s=hang_limit(torch.device(device).type, RENDER_LIMIT_PER_WINDOW_S))
        atexit.register(self._kill_at_exit)  # runs before multiprocessing's exit hook, whose SIGTERM it ignores
        started = time.monotonic()
        while True:
            try:
                started_message = self.connector.get(PCM, 1.0)
            except ConnectorTimeout:
                if not self.process.is_alive():
                    self.close()
                    raise Music3Error(
                        f"the stage-1 worker exited with code {self.process.exitcode} while starting"
                    ) from None
                if time.monotonic() - started > STARTUP_TIMEOUT_S:
                    self.close()
                    raise Music3Error(f"the stage-1 worker was not ready after {STARTUP_TIMEOUT_S:.0f} s") from None
                continue
            if started_message.key == "failed":
                self.close()
                raise Music3Error(f"the stage-1 worker could not start: {started_message.meta['error']}")
            break
        # The worker holds its own ends now. Without this process's copies of the ends it never uses, the worker's
        # death reaches it at once (end of file on PCM, broken pipe on WINDOWS) instead of a read that never ends.
        self.connector.release(PCM, "writer")
        self.connector.release(WINDOWS, "reader")

    def send_window(self, payload: WindowPayload) -> None:
        """Queue a window for the outbox's writer (its copy to the host happens here)."""
        message = window_message(payload)
        self.deadlines.sent(payload.song, payload.steps)  # before it can be answered
        self.outbox.put(message)

    def send_cancel(self, song: str) -> None:
        self.outbox.put(Message("cancel", {"song": song}, {}))

    def receive(self, timeout_s: float) -> Message | None:
        """The worker's next chunk, failure report or last word ("stopped", with its reason), or None (its
        heartbeats go to the watch)."""
        try:
            message = self.connector.get(PCM, timeout_s)
        except ConnectorTimeout:
            return None
        self.watch.heard_from(message)
        if message.key == "chunk":
            self.deadlines.answered(message.meta["song"], message.meta["last"])
        elif message.key == "alive" and message.meta["busy_s"] > 0:
            self.deadlines.restart()
        return None if message.key == "alive" else message

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """Kill the worker now (if it still runs); drop what waits for it and remove its segments and those of the
        windows it will never read (after the writer stopped, so none is made after the cleanup)."""
        self.outbox.close()
        self.process.kill()
        self.process.join(timeout=10)
        self.outbox.join(timeout_s=5)  # its pipe has no reader left: a write in progress fails now
        self.connector.cleanup()

    def _kill_at_exit(self) -> None:
        """An engine never closed: at interpreter exit the worker is killed here (multiprocessing would send it a
        SIGTERM, which it ignores, and then wait for it forever)."""
        if self.process.is_alive():
            self.kill()

    def close(self) -> None:
        """Stop the worker (killing it if it does not stop) and remove every shared-memory segment."""
        atexit.unregister(self._kill_at_exit)
        if self.process.is_alive():
            self.outbox.close(Message("stop", {}, {}))
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.kill()
        self.outbox.close()
        self.connector.cleanup()
        self.connector.close()  # a writer blocked on a worker that never read is released here
        self.outbox.join(timeout_s=5)
