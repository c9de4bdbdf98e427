"""Connectors: how messages travel between stages and back to the API server.

A message is ``(key, meta, tensors)``: ``key`` names the request it belongs to, ``meta`` is a dict of JSON-able
values, ``tensors`` a dict of named ``torch.Tensor`` or ``numpy.ndarray``. In practice: window payloads
[200, 4096] float32 (3.3 MB) from stage 0 to stage 1, stereo PCM chunks [2, N] float32 from stage 1 back to the
API server, and small events with no tensors at all.

Two implementations of the :class:`Connector` protocol:

- :class:`InProcessConnector` (here): one ``queue.Queue`` per channel, for stages that share a process (threads);
  the tensors are passed by reference, nothing is copied.
- :class:`SharedMemoryConnector` (:mod:`.shared_memory`): for stages in different processes; large tensors
  travel in shared-memory segments that never outlive their use (:mod:`.shm_segments`).

The message, the settings, the errors and the bounded wait both share live in :mod:`.connector_base`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from ..errors import Music3Error
from .connector_base import (
    BoundedWait,
    ConnectorError,
    ConnectorSettings,
    ConnectorTimeout,
    LostMessage,
    Message,
    PeerGone,
    channel_names,
    check_message,
    timeouts,
)
from .shared_memory import SharedMemoryConnector

__all__ = [
    "Connector",
    "ConnectorError",
    "ConnectorSettings",
    "ConnectorTimeout",
    "InProcessConnector",
    "LostMessage",
    "Message",
    "PeerGone",
    "SharedMemoryConnector",
    "make_connector",
    "timeouts",
]


@runtime_checkable
class Connector(Protocol):
    """What a stage or the API server uses to hand messages over; every channel is a FIFO."""

    def put(self, channel: str, message: Message | tuple[str, dict, dict]) -> None: ...

    def get(self, channel: str, timeout_s: float | None) -> Message:
        """The next message on ``channel``; ``ConnectorTimeout`` after ``timeout_s`` (None: no limit, 0: no wait)."""
        ...

    def close(self) -> None: ...

    def cleanup(self, pid: int | None = None) -> int:
        """Remove what a dead process left behind; returns how many shared-memory segments were unlinked."""
        ...


class InProcessConnector:
    """Channels as ``queue.Queue`` in one process; messages (and their tensors) are passed by reference.

    ``channels``: the allowed channel names, or None to create a channel on first use."""

    def __init__(
        self, extra: Mapping[str, Any] | ConnectorSettings | None = None, *, channels: Iterable[str] | None = None
    ):
        self.settings = ConnectorSettings.from_extra(extra)
        self._declared = None if channels is None else channel_names(channels)
        self._queues: dict[str, queue.Queue] = {name: queue.Queue() for name in self._declared or ()}
        self._lock = threading.Lock()
        self._closed = False

    def _queue(self, channel: str) -> queue.Queue:
        with self._lock:
            q = self._queues.get(channel)
            if q is None:
                if self._declared is not None:
                    raise ConnectorError(f"unknown channel {channel!r}; this connector has {list(self._declared)}")
                if not isinstance(channel, str):
                    raise ConnectorError(f"channel names are str, got {channel!r}")
                q = self._queues[channel] = queue.Queue()
            return q

    def put(self, channel: str, message: Message | tuple[str, dict, dict]) -> None:
        self._check_open()
        self._queue(channel).put(check_message(message))

    def get(self, channel: str, timeout_s: float | None) -> Message:
        self._check_open()
        q = self._queue(channel)
        wait = BoundedWait(channel, timeout_s, self.settings.get_sleep_s)
        while True:
            step = wait.step()
            try:
                return q.get(timeout=step) if step > 0 else q.get_nowait()
            except queue.Empty:
                pass
            self._check_open()
            wait.check_expired()

    def close(self) -> None:
        """Drop every queued message; a ``get`` waiting in another thread raises ConnectorError."""
        self._closed = True
        with self._lock:
            self._queues.clear()

    def cleanup(self, pid: int | None = None) -> int:
        """Nothing to clean up in one process; there for symmetry with SharedMemoryConnector."""
        return 0

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorError("the connector is closed")


_KINDS = {"SharedMemoryConnector": SharedMemoryConnector}


def make_connector(
    kind_name: str, extra: Mapping[str, Any] | None = None, *, channels: Iterable[str] = ()
) -> SharedMemoryConnector:
    """The connector a deploy YAML names (``connectors.<name>.name``), built from its ``extra`` block."""
    cls = _KINDS.get(kind_name) if isinstance(kind_name, str) else None
    if cls is None:
        raise Music3Error(f"unknown connector {kind_name!r}; allowed: {', '.join(_KINDS)}")
    return cls(extra, channels=channels)
