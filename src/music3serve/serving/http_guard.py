"""The HTTP/1.1 protocol the API server runs: uvicorn's h11 protocol with two guards it lacks.

- A deadline for reading each request, from the connection's opening (or the start of a request after an answered
  one) to the request's last body byte. uvicorn has none, so a client that opens a connection and never finishes
  its request would hold it, and an open file, forever.
- A JSON 413 for a Content-Length of more than 20 digits, which h11 refuses itself (with a plain-text 400) before
  the app's own check (body_limits.BoundedBody) could see it.
- Whether the bytes written have reached the client (its TCP acknowledged them), for the app to say whether a
  song's end was delivered (song_stream.UNACKNOWLEDGED).
- A cap on open connections below the open-files limit: beyond it a new connection is closed at once, so accept()
  does not run out of files (it then fails, and asyncio logs each failure with a traceback, thousands a second;
  AcceptErrorsOncePerMinute turns bursts that get past the cap into one line a minute with a count).

Server-only (imports uvicorn and h11), like serving/api.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import struct
import sys
import time
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .body_limits import MAX_BODY_BYTES, too_large
from .error_bodies import error_reply_for
from .song_stream import RESET, UNACKNOWLEDGED

log = logging.getLogger(__name__)

REQUEST_READ_S = 30.0  # the largest body (1 MiB) arrives well within this even over a slow link
WARN_EVERY_S = 60.0  # refused connections and accept() failures are logged once per this interval, with a count
HEAD_KEPT = 64 * 1024  # of a request's head as it arrives, to read its Content-Length where h11 refused it
LONG_LENGTH = re.compile(rb"^content-length[ \t]*:[ \t]*([0-9]{21,})[ \t]*\r?$", re.IGNORECASE | re.MULTILINE)


class Throttled:
    """One log line per WARN_EVERY_S for an event that may come thousands of times a second: the first at once, the
    ones after it as a count, with the next line or WARN_EVERY_S after the last (inside an event loop)."""

    def __init__(self, emit: Callable[[int], None]):
        self.emit, self.held, self.last = emit, 0, float("-inf")
        self.flush: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= WARN_EVERY_S:
            self._emit(self.held + 1)
            return
        self.held += 1
        if self.flush is None:
            with contextlib.suppress(RuntimeError):  # no loop running: the count waits for the next event
                self.flush = asyncio.get_running_loop().call_later(self.last + WARN_EVERY_S - now, self._flushed)

    def _flushed(self) -> None:
        self.flush = None
        if self.held:
            self._emit(self.held)

    def _emit(self, count: int) -> None:
        if self.flush is not None:
            self.flush.cancel()
            self.flush = None
        self.held, self.last = 0, time.monotonic()
        self.emit(count)


def _refused(count: int) -> None:
    log.warning("connections refused: too many open", extra={"refused": count})


def _accept_failed(count: int) -> None:
    log.error("accept() ran out of open files: connections wait in the kernel's queue (raise the open-files limit)",
              extra={"failures": count})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-read deadline and a connection cap (`max_connections`, set by
    `guarded_protocol`). The deadline runs while a request is being received: from the connection's opening, or
    from the first byte of a request that comes after an answered one (pipelined, or on a kept-alive connection),
    until its last body byte, also when the answer came first; uvicorn's own keep-alive timer covers the idle time
    between requests (armed here after a body that came after its answer, where uvicorn left the connection with no
    timer at all)."""

    max_connections: int | None = None
    refusals = Throttled(_refused)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._head = b""
        self._lost = False
        self._left_unacknowledged: int | None = None  # once lost: the bytes it left (None: lost to an error)
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            self.refusals()
            transport.abort()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # the start of a request: its head is kept until h11 has read it
            self._head = (self._head + data)[:HEAD_KEPT]
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._head = b""

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot read; one whose Content-Length h11 refused for its length (over 20
        digits) gets the JSON 413 (or 400) the app gives any other body too large (or a length it cannot read), in
        its route's error body (serving/error_bodies.py)."""
        found = LONG_LENGTH.search(self._head.partition(b"\r\n\r\n")[0])  # in the head, not a body after it
        if found is None:
            return super().send_400_response(msg)
        written = found.group(1).decode()
        digits = written.lstrip("0") or "0"
        status, message = 413, too_large(digits)
        if len(digits) <= len(str(MAX_BODY_BYTES)):  # leading zeros: a small length, but too long for h11
            status, message = 400, f"Content-Length has {len(written)} digits; write it without leading zeros"
        target = self._head.split(b" ", 2)[1:2] or [b"/"]  # the request line's path: its route's error body
        body = error_reply_for(target[0].decode("latin-1").partition("?")[0])(status, message).body
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))  # h11 lets a server answer a request it could not read
        self.transport.close()

    def handle_events(self) -> None:
        """Runs on every arrival of data and after every answered request (which may start a pipelined one)."""
        super().handle_events()
        if self.cycle is not None:  # set as the request arrives, before its app task starts
            extensions = self.cycle.scope.setdefault("extensions", {})
            extensions.setdefault(RESET, {"reset": self._reset})
            extensions.setdefault(UNACKNOWLEDGED, {"bytes": self._unacknowledged,
                                                   "open": lambda: not self.transport.is_closing()})
        state = self.conn.their_state
        receiving = state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))
        upgraded = self.transport.get_protocol() is not self
        if not receiving or upgraded:  # read, idle, done, or upgraded away
            self._disarm()
            idle = state is h11.IDLE and self.conn.our_state is h11.IDLE
            if idle and not upgraded and self.timeout_keep_alive_task is None and not self.transport.is_closing():
                # The body of a request answered before it was read came after the answer: its bytes cancelled the
                # keep-alive timer uvicorn armed at the answer, and uvicorn arms none once they are read.
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)
        elif self._deadline is None:
            self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY:
            # Answered before its body was read: the rest of the body is still the request's, bounded by the read
            # deadline; uvicorn's keep-alive timer would close the connection under a client pausing mid-body.
            self._unset_keepalive_if_required()

    def _unacknowledged(self) -> int | None:
        """Bytes written to the connection and not yet acknowledged by the client's TCP: those the transport still
        holds, and on Linux those in the kernel's send queue (SIOCOUTQ). Once the connection is lost, those it left
        (a client that closes as soon as it has read a whole response is no loss); None where it was lost to an
        error, which may empty the kernel's queue."""
        return self._left_unacknowledged if self._lost else self._held()

    def _held(self) -> int:
        held = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sys.platform == "linux" and sock is not None:
            import fcntl
            import termios

            with contextlib.suppress(OSError):
                held += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        return held

    def _reset(self) -> None:
        """Close the connection with a TCP reset: a zero linger time makes the close send RST, not FIN."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._left_unacknowledged = self._held() if exc is None else None  # asyncio closes the socket after this
        self._lost = True
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
    the cap can close them), asyncio logs the error with a traceback for every attempt, thousands a second; they
    become one line of ours per WARN_EVERY_S, with their count."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = Throttled(_accept_failed)

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("socket.accept() out of system resource"):
            return True
        self.failures()
        return False


def guarded_protocol(max_connections: int | None) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's `http` setting, with this connection cap (None: no cap)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"max_connections": max_connections})
