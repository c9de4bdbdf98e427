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
    before it is written (into shared memory, 3.3 MB) and the reader gives it back once it has read the window, so a
    reader that is busy rendering leaves the rest waiting here, in this process's memory, not in /dev/shm. Cancels go
    out ahead of the windows waiting (the worker stops rendering the song at once)."""

    def __init__(self, connector, channel: str, slots: Any = None):
        self.connector, self.channel, self.slots = connector, channel, slots
        self._queue: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._cancels: list[Message] = []  # written ahead of the queue
        # Songs whose windows are dropped: from their cancel until the queue has passed their last window (a
        # "forget" marker queued behind the cancel); ids are never reused.
        self._skipped: set[str] = set()
        self._closing = False  # closing: windows still queued are dropped
        self._lock = threading.Lock()
        self._failures: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="music3-stage1-sender", daemon=True)
        self._thread.start()

    def put(self, message: Message) -> None:
        if message.key == "cancel":
            song = message.meta["song"]
            with self._lock:
                self._skipped.add(song)
                self._cancels.append(message)
            message = Message("forget", {"song": song}, {})  # wakes the writer; marks the end of the song's windows
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
            self._send_cancels()
            song = message.meta.get("song")
            if message.key == "forget":
                with self._lock:
                    self._skipped.discard(song)
                continue
            if message.key == "window" and not self._slot_for(song):
                continue
            self._send(message)
            if message.key == "stop":
                return

    def _send(self, message: Message) -> None:
        try:
            self.connector.put(self.channel, message)
        except Exception as exc:  # a closed connector, a full /dev/shm, a pipe without reader
            if message.key != "window":
                log.warning("message %r to stage 1 not sent: %s", message.key, exc)
                return
            song = message.meta["song"]
            if self.slots is not None:
                self.slots.release()  # never written: nobody will read it
            with self._lock:
                self._skipped.add(song)  # its later windows would only arrive out of order
            self._failures.put((song, f"stage 1 could not take window {message.meta['index']}: {exc}"))

    def _send_cancels(self) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, []
        for cancel in cancels:
            self._send(cancel)

    def _slot_for(self, song: str) -> bool:
        """Whether a window of `song` is to be written: not skipped, and a slot taken for it (waiting for the reader
        as long as it takes, cancels going out meanwhile, unless the window is dropped or the outbox closes)."""
        while not self._dropped(song):
            if self.slots is None:
                return True
            if self.slots.acquire(timeout=SLOT_POLL_S):
                if not self._dropped(song):  # still wanted once the slot came
                    return True
                self.slots.release()
            self._send_cancels()
        return False

    def _dropped(self, song: str) -> bool:
        with self._lock:
            return self._closing or song in self._skipped
