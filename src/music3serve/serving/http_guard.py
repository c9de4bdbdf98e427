"""The HTTP/1.1 protocol the API server runs: uvicorn's h11 protocol with two guards it lacks.

- A deadline for reading each request, from the connection's opening (or the first byte of the next request on a
  kept-alive connection) to the request's last body byte. uvicorn has none, so a client that opens a connection and
  never finishes its request would hold it, and an open file, forever.
- A cap on open connections below the open-files limit: beyond it a new connection is closed at once, so accept()
  does not run out of files (it then fails, and asyncio logs each failure with a traceback, thousands a second;
  AcceptErrorsOncePerMinute keeps one a minute for bursts that get past the cap).

Server-only (imports uvicorn and h11), like serving/api.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

REQUEST_READ_S = 30.0  # the largest body (1 MiB) arrives well within this even over a slow link
WARN_EVERY_S = 60.0  # refused connections are logged once per this interval, with their count


class _Refusals:
    """Connections closed at the cap since the last warning (shared by all connections of the process)."""

    count = 0
    last_warning = float("-inf")

    @classmethod
    def record(cls, open_connections: int, cap: int) -> None:
        cls.count += 1
        now = time.monotonic()
        if now - cls.last_warning >= WARN_EVERY_S:
            log.warning("connections refused: too many open", extra={"refused": cls.count, "open": open_connections,
                                                                      "max_connections": cap})
            cls.count, cls.last_warning = 0, now


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-read deadline and a connection cap (`max_connections`, set by
    `guarded_protocol`)."""

    max_connections: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            _Refusals.record(len(self.connections), self.max_connections)
            transport.abort()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the next request on a kept-alive connection begins
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()  # the request is read (or the connection is done)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(REQUEST_READ_S, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        log.debug("connection closed: its request was not read in time", extra={"client": self.client,
                                                                                  "limit_s": REQUEST_READ_S})
        self.transport.close()


class AcceptErrorsOncePerMinute(logging.Filter):
    """For the asyncio logger: when accept() runs out of files anyway (connections arrive in bursts, accepted before
    the cap can close them), asyncio logs the error with a traceback for every attempt, thousands a second; let one
    through per WARN_EVERY_S, saying how many it held back."""

    def __init__(self) -> None:
        super().__init__()
        self.held_back, self.last = 0, float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("socket.accept() out of system resource"):
            return True
        now = time.monotonic()
        if now - self.last < WARN_EVERY_S:
            self.held_back += 1
            return False
        record.msg, record.args, record.exc_info, record.exc_text = (
            f"socket.accept() out of open files (raise the open-files limit; {self.held_back} such errors held back "
            f"since the last one)", (), None, None)
        self.held_back, self.last = 0, now
        return True


def guarded_protocol(max_connections: int | None) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's `http` setting, with this connection cap (None: no cap)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"max_connections": max_connections})
