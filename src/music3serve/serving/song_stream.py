"""A song's HTTP response on its way to the client: sent in pieces, each of which must leave within WRITE_STALL_S;
what the connection accepted (samples_sent) and whether the song's end reached the client (delivered); a client
that goes away or stops reading ends it. Streamed and whole songs alike (serving/song_service.py builds them).
Server-only, like serving/api.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Protocol

from starlette.requests import Request
from starlette.responses import StreamingResponse

log = logging.getLogger(__name__)

# The ASGI scope extensions by which the server (serving/http_guard) tells the app about a connection:
# RESET {"reset": callable}: close it with a TCP reset. A response without the chunked encoding (HTTP/1.0) cannot say
# it was cut short but by a reset (a plain close reads as its end), and a close waits for buffers a stalled client
# never reads. UNACKNOWLEDGED {"bytes": callable, "open": callable}: the response's bytes written but not yet
# acknowledged by the client's TCP (once the connection is lost, those it left; None where that is unknown), and
# whether the connection still takes writes.
RESET = "music3serve.reset"
UNACKNOWLEDGED = "music3serve.unacknowledged"
SEND_PIECE_BYTES = 256 * 1024  # one send at most: each must drain within WRITE_STALL_S, even for a slow reader
# A client playing the stream in real time frees a window's bytes within ~8 s; one that reads nothing for this
# long is gone or stuck, and its response is cut rather than held (a streamed song is cancelled).
WRITE_STALL_S = 120.0
ACK_POLL_S = (0.005, 0.5)  # first and longest wait between two looks at the bytes not yet acknowledged
# A piece of a response: its bytes and the samples (per channel, at the output rate) they complete; a header or a
# framing event carries none, and a compressed file's piece its share of the samples encoded into it.
Piece = tuple[bytes, int]


def pieces(data: bytes, samples: int) -> Iterator[Piece]:
    """data, which encodes `samples`, in pieces of at most SEND_PIECE_BYTES, each with its share of the samples."""
    for start in range(0, len(data), SEND_PIECE_BYTES):
        end = min(start + SEND_PIECE_BYTES, len(data))
        yield data[start:end], samples * end // len(data) - samples * start // len(data)


class SongFailedMidStream(RuntimeError):
    """Raised out of a streaming response so the server drops the connection before the final chunk."""


class ClientStalled(OSError):
    """The client read nothing for WRITE_STALL_S while a piece of its song waited to be sent."""


class Sending(Protocol):
    """What a response reports on: the song's state and counts (api.SongState)."""

    name: str
    state: str
    samples_sent: int
    delivered: bool


async def watch_disconnect(request: Request, gone: Callable[[], None]) -> None:
    """Call `gone` when the client goes away (the request body has been read, so only http.disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone()


class SongStream(StreamingResponse):
    """A song's response: streamed (chunked) or whole (a Content-Length), sent as `content` yields its pieces. It
    counts the song's samples the connection accepted (the pieces' samples), says whether the song's end reached the
    client, tells `gone` when the client disconnects or stops reading (whatever the ASGI version), and always runs
    `close` (the body's own cleanup may be in code that never started)."""

    def __init__(self, content: AsyncIterator[Piece], song: Sending, gone: Callable[[], None],
                 close: Callable[[], Awaitable[None]], **kwargs: Any):
        super().__init__(self._bytes(content), **kwargs)
        self.song, self.gone, self.close = song, gone, close
        self.left, self.in_flight = False, 0  # in_flight: the samples of the piece being sent

    async def _bytes(self, content: AsyncIterator[Piece]) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(content):  # type: ignore[type-var]
            async for data, samples in content:
                self.in_flight = samples
                yield data

    def _gone(self) -> None:
        if not self.left:
            self.left = True
            self.gone()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        extensions = scope.get("extensions", {})
        guard = extensions.get(UNACKNOWLEDGED, {})
        probe = guard.get("bytes", lambda: None if self.left else 0)  # elsewhere: a write taken is sent
        connected = guard.get("open", lambda: True)
        watcher = asyncio.ensure_future(watch_disconnect(Request(scope, receive), self._gone))

        async def send_or_give_up(message: dict) -> None:
            body = message.get("body", b"")
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.song.delivered = self.song.state == "done" and await self._acknowledged(probe)
            accepted = bool(body) and not self.left and connected()  # uvicorn drops what a closed one is sent
            try:
                await asyncio.wait_for(send(message), WRITE_STALL_S)
            except TimeoutError:
                self._stalled()
            if accepted:  # counted also where the client took the bytes and closed while they drained
                self.song.samples_sent += self.in_flight
            self.in_flight = 0

        ended = stalled = False
        try:
            await self.stream_response(send_or_give_up)
            ended = True
        except OSError as exc:  # the client went away between two chunks (ASGI 2.4 servers raise on send), or stalled
            stalled = isinstance(exc, ClientStalled)
            self._gone()
        finally:
            watcher.cancel()
            reset = extensions.get(RESET)
            if not ended and reset and (stalled or scope.get("http_version") == "1.0"):
                reset["reset"]()  # frees a stalled client's buffers at once; over HTTP/1.0, says the body was cut
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.close()
            log.info("song response ended", extra={"song": self.song.name, "state": self.song.state,
                                                   "samples": self.song.samples_sent, "delivered": self.song.delivered})

    async def _acknowledged(self, unacknowledged: Callable[[], int | None]) -> bool:
        """Whether every byte sent so far reached the client's TCP (its acknowledgement), waiting up to WRITE_STALL_S;
        also for a client that closed once it had them all, not for one that left before."""
        wait, waited = ACK_POLL_S[0], 0.0
        while (left := unacknowledged()) != 0:
            if left is None or self.left:  # the connection is lost (the client left): its count is final
                return False
            if waited >= WRITE_STALL_S:
                self._stalled()
            await asyncio.sleep(wait)
            waited, wait = waited + wait, min(2 * wait, ACK_POLL_S[1])
        return True

    def _stalled(self) -> None:
        log.warning("client stopped reading", extra={"song": self.song.name, "samples": self.song.samples_sent})
        CutResponses.stalled += 1  # uvicorn will log this response as unfinished
        raise ClientStalled(f"the client read nothing for {WRITE_STALL_S:g} s")


class HeldAudio:
    """A whole song's pieces, read from the engine and not yet sent: they count toward the engine's unread-audio
    budget (`hold`: Engine.hold_read_audio) until the client has taken them, so clients that stop reading cannot
    fill the host's memory with finished songs."""

    def __init__(self, hold: Callable[[int], None]):
        self.hold, self.pieces, self.bytes = hold, deque[Piece](), 0

    def add(self, data: bytes, samples: int) -> None:
        self.hold(len(data))
        self.pieces.append((data, samples))
        self.bytes += len(data)

    async def send(self, opening: bytes, ending: bytes) -> AsyncIterator[Piece]:
        """`opening`, then each piece, given back to the budget once the connection has taken it, then `ending`."""
        yield opening, 0
        while self.pieces:
            yield self.pieces[0]
            self.hold(-len(self.pieces.popleft()[0]))
        if ending:
            yield ending, 0

    def release(self) -> None:
        self.hold(-sum(len(data) for data, _ in self.pieces))
        self.pieces.clear()

    async def closed(self) -> None:
        self.release()


class CutResponses(logging.Filter):
    """uvicorn logs the responses this app cuts on purpose as errors: each request task it cancels once the shutdown
    grace is over as "Exception in ASGI application" with a CancelledError traceback, and a response SongStream ended
    because its client stopped reading as "ASGI callable returned without completing response.", and a stream cut
    because its song failed as "Exception in ASGI application" with a SongFailedMidStream traceback (the failure
    itself is logged as an error where it happened); before cutting at shutdown it says "Cancel N running task(s),
    timeout graceful shutdown exceeded". All are documented behaviour: each becomes one warning line. (Any other
    unfinished response stays an error.)"""

    stalled = 0  # responses SongStream cut for a stalled client whose unfinished response uvicorn has not logged yet

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if (isinstance(error, asyncio.CancelledError) and "graceful shutdown" in str(error)
                and message.startswith("Exception in ASGI")):
            self._warn(record, "a response was cut at shutdown (the grace period was over, or a second Ctrl-C)")
        elif isinstance(error, SongFailedMidStream) and message.startswith("Exception in ASGI"):
            self._warn(record, f"a response was cut: {error}")
        elif message.startswith("Cancel ") and message.endswith("timeout graceful shutdown exceeded"):
            self._warn(record, f"{message} (the grace period was over, or a second Ctrl-C)")
        elif message == "ASGI callable returned without completing response." and CutResponses.stalled > 0:
            CutResponses.stalled -= 1
            self._warn(record, "a response was cut: its client stopped reading (a streamed song is cancelled)")
        return True

    @staticmethod
    def _warn(record: logging.LogRecord, message: str) -> None:
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg, record.args, record.exc_info, record.exc_text = message, (), None, None
