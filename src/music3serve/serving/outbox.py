"""Messages from the engine to its stage-1 worker, written by a thread of their own (the split placement)."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from .connectors import Message

log = logging.getLogger(__name__)

SLOT_POLL_S = 0.05  # how often a writer waiting for a slot looks whether its window was cancelled or closing


class Outbox:
    """The talker hands windows and cancels over and goes on: a worker that is slow to read (or hung, until the
    engine's watch stops it) holds up this thread only. Nothing is refused: what waits here is bounded by the songs
    the engine admits. Windows of a song cancelled (or whose earlier window could not be written) are skipped, and
    the windows the connector could not take come back from `failures()` as (song, reason).

    `slots`, a semaphore shared with the reader, bounds the windows written and not yet read: each window takes one
    before it is written (into shared memory, 3.2 MB) and the reader gives it back once it has read the window, so a
    reader that is busy rendering leaves the rest waiting here, in this process's memory, not in /dev/shm."""

    def __init__(self, connector, channel: str, slots: Any = None):
        self.connector, self.channel, self.slots = connector, channel, slots
        self._queue: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._skipped: set[str] = set()  # songs whose queued windows are dropped, until their cancel is written
        self._closing = False  # closing: windows still queued are dropped
        self._lock = threading.Lock()
        self._failures: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="music3-stage1-sender", daemon=True)
        self._thread.start()

    def put(self, message: Message) -> None:
        if message.key == "cancel":
            with self._lock:
                self._skipped.add(message.meta["song"])
        self._queue.put(message)

    def failures(self) -> list[tuple[str, str]]:
        out = []
        while not self._failures.empty():
            out.append(self._failures.get())
        return out

    def close(self, last: Message | None = None) -> None:
        """Drop the windows still queued; `last` (say a stop) still goes out after the messages before it, then the
        writer ends."""
        self._closing = True
        self._queue.put(last)

    def join(self, timeout_s: float) -> bool:
        """Wait for the writer to end (it may be blocked in a write until the connector is closed)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _write(self) -> None:
        while (message := self._queue.get()) is not None:
            song = message.meta.get("song")
            if message.key == "window" and not self._slot_for(song):
                continue
            try:
                self.connector.put(self.channel, message)
            except Exception as exc:  # a closed connector, a full /dev/shm, a pipe without reader
                if message.key == "window":
                    if self.slots is not None:
                        self.slots.release()  # never written: nobody will read it
                    with self._lock:
                        self._skipped.add(song)  # its later windows would only arrive out of order
                    self._failures.put((song, f"stage 1 could not take window {message.meta['index']}: {exc}"))
                else:
                    log.warning("message %r to stage 1 not sent: %s", message.key, exc)
            if message.key == "cancel":
                with self._lock:
                    self._skipped.discard(song)  # ids are never reused: nothing of it comes after its cancel
            elif message.key == "stop":
                return

    def _slot_for(self, song: str) -> bool:
        """Whether a window of `song` is to be written: not skipped, and a slot taken for it (waiting for the reader
        as long as it takes, unless the window is skipped or the outbox closes meanwhile)."""
        while not self._dropped(song):
            if self.slots is None:
                return True
            if self.slots.acquire(timeout=SLOT_POLL_S):
                if not self._dropped(song):  # still wanted once the slot came
                    return True
                self.slots.release()
        return False

    def _dropped(self, song: str) -> bool:
        with self._lock:
            return self._closing or song in self._skipped
