"""The API server's HTTP protocol (serving/http_guard.py): a client that never finishes its request loses its
connection after REQUEST_READ_S, and connections past the cap are closed at once; whole requests are untouched."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from typing import Callable

import pytest

pytest.importorskip("uvicorn")

from music3serve.serving import http_guard  # noqa: E402 (after the skip: it imports uvicorn)


async def echo(scope, receive, send) -> None:
    """Answers a request with its body; /unread answers 404 without reading it, /slow streams its answer over ~1 s."""
    assert scope["type"] == "http"
    if scope["path"] == "/unread":
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    if scope["path"] == "/slow":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        for _ in range(5):
            await asyncio.sleep(0.2)
            await send({"type": "http.response.body", "body": b"xx", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection within `seconds` (reading and dropping anything it sends)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def drip(sock: socket.socket, data: bytes, every: float, for_s: float) -> bool:
    """Sends `data` a byte every `every` s until the server closes the connection: whether it did within `for_s`."""
    start = time.monotonic()
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return True
        if closed_within(sock, every):
            return True
        if time.monotonic() - start > for_s:
            return False
    raise AssertionError(f"{len(data)} bytes is too few to drip for {for_s} s")


def request(body: bytes, path: bytes = b"/") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (path, len(body), body)


def response(sock: socket.socket, ending: bytes = b"hello") -> bytes:
    sock.settimeout(5)
    data = b""
    while not data.endswith(ending):
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the connection after {data!r}"
        data += chunk
    return data


@pytest.fixture
def guarded(serve_http, monkeypatch):
    """serve(max_connections) -> the URL of the echo app behind the guarded protocol, with a 0.5 s read deadline."""
    monkeypatch.setattr(http_guard, "REQUEST_READ_S", 0.5)

    def serve(max_connections: int | None = None):
        return serve_http(echo, http=http_guard.guarded_protocol(max_connections))

    return serve


@pytest.mark.parametrize("sent", [b"", b"POST / HTTP/1.1\r\nHost: t\r\n", request(b"hello")[:-2]],
                         ids=["nothing", "part of the headers", "part of the body"])
def test_a_request_not_read_in_time_loses_its_connection(guarded, sent):
    with guarded() as url, connect(url) as sock:
        sock.sendall(sent)
        assert closed_within(sock, 5)


def test_whole_requests_pass_and_a_kept_alive_connection_waits_idle_past_the_deadline(guarded):
    with guarded() as url, connect(url) as sock:
        sock.sendall(request(b"hello"))
        assert response(sock).startswith(b"HTTP/1.1 200")
        for _ in range(2):
            time.sleep(1.0)  # idle between requests: uvicorn's keep-alive (5 s) applies, not the read deadline
            sock.sendall(request(b"hello"))
            assert response(sock).startswith(b"HTTP/1.1 200")


def test_a_request_sent_slowly_within_the_deadline_is_served(guarded):
    with guarded() as url, connect(url) as sock:
        for piece in (request(b"hello")[:20], request(b"hello")[20:]):
            sock.sendall(piece)
            time.sleep(0.2)
        assert response(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("before", [b"POST / HTTP/1.1\r\nHost: t\r\nX-Drip: ", request(b"x" * 1000)[:-1000]],
                         ids=["headers", "body"])
def test_a_request_kept_unfinished_by_a_drip_of_bytes_loses_its_connection(guarded, before):
    """The deadline runs from the request's start, not from the last byte received: a byte every 0.1 s (a fifth of
    the 0.5 s deadline) held a connection for as long as the client kept it up if each byte re-armed the deadline."""
    with guarded() as url, connect(url) as sock:
        sock.sendall(before)
        assert drip(sock, b"x" * 100, every=0.1, for_s=3.0)


def test_a_pipelined_request_gets_its_own_deadline(guarded):
    """A request that came in the same packet as the one before it starts only once that one is answered: it was
    never given a deadline, and one packet held the connection forever."""
    with guarded() as url, connect(url) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n" + request(b"hello")[:-5])  # the second lacks its body
        assert response(sock, b"\r\n\r\n").startswith(b"HTTP/1.1 200")
        assert closed_within(sock, 5)


def test_the_next_request_sent_during_a_long_answer_is_timed_from_the_answers_end(guarded):
    """The answer (1 s) outlasts the deadline (0.5 s) without being cut; the request sent meanwhile, never finished,
    loses the connection after it."""
    with guarded() as url, connect(url) as sock:
        sock.sendall(request(b"", b"/slow"))
        time.sleep(0.1)
        sock.sendall(request(b"hello")[:20])
        assert response(sock, b"xxxxxxxxxx").startswith(b"HTTP/1.1 200")
        assert closed_within(sock, 5)


def test_a_request_after_one_whose_body_went_unread_is_timed_from_its_own_start(guarded):
    """The first request's deadline went on running into the next request on the connection."""
    with guarded() as url, connect(url) as sock:
        sock.sendall(request(b"hello", b"/unread")[:-5])
        assert response(sock, b"\r\n\r\n").startswith(b"HTTP/1.1 404")
        sock.sendall(b"hello")  # the body, after its answer
        time.sleep(0.4)
        for piece in (request(b"hello")[:20], request(b"hello")[20:]):
            sock.sendall(piece)
            time.sleep(0.3)
        assert response(sock).startswith(b"HTTP/1.1 200")


def test_a_body_that_came_after_its_answer_is_bounded_by_the_deadline_not_the_keep_alive(serve_http, monkeypatch):
    """An answer given before its request's body was read: uvicorn armed its keep-alive timer (here 0.3 s) at the
    answer, which closed the connection under a client pausing in its body, the rest of the body refused; and once
    the body came, no timer was armed at all: the connection was held open, idle, for as long as the client liked.
    Now the read deadline (here 2 s) bounds the body, and the keep-alive the idle connection after it."""
    monkeypatch.setattr(http_guard, "REQUEST_READ_S", 2.0)
    with serve_http(echo, http=http_guard.guarded_protocol(None), timeout_keep_alive=0.3) as url, connect(url) as sock:
        sock.sendall(request(b"hello", b"/unread")[:-5])
        assert response(sock, b"\r\n\r\n").startswith(b"HTTP/1.1 404")
        time.sleep(0.8)  # the keep-alive's time, not the deadline's
        sock.sendall(b"hello" + request(b"hello"))  # the body, after its answer, and the next request
        assert response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(request(b"hello", b"/unread")[:-5])
        assert response(sock, b"\r\n\r\n").startswith(b"HTTP/1.1 404")
        sock.sendall(b"hello")
        assert closed_within(sock, 1.5)  # idle after the body: the keep-alive (0.3 s) closes it, well before 2 s


def test_a_connection_gone_before_its_deadline_is_not_timed_out_after(guarded, caplog, monkeypatch):
    """A connection that goes away disarms its deadline: the timer no longer fires on it once it is gone (closing
    a closed transport). The second connection's deadline comes after the first's, so by the time it is closed the
    first's would have fired. (A deadline of 2 s: the server sees the first one go well before it, even on a busy
    machine.)"""
    monkeypatch.setattr(http_guard, "REQUEST_READ_S", 2.0)
    with caplog.at_level(logging.DEBUG, logger=http_guard.__name__), guarded() as url:
        with connect(url) as gone:
            gone.sendall(b"POST / HTTP/1.1\r\n")
        with connect(url) as slow:
            slow.sendall(b"POST / HTTP/1.1\r\n")
            assert closed_within(slow, 5)
            timed_out = [r.client for r in caplog.records if r.getMessage().endswith("was not read in time")]
            assert timed_out == [slow.getsockname()]


@pytest.fixture
def quick_warnings(monkeypatch):
    """Once-a-minute warnings every 0.3 s, the counts starting afresh."""
    monkeypatch.setattr(http_guard, "WARN_EVERY_S", 0.3)
    monkeypatch.setattr(http_guard.GuardedH11Protocol, "refusals", http_guard.Throttled(http_guard._refused))


def test_connections_past_the_cap_are_closed_at_once(guarded, monkeypatch, caplog, quick_warnings):
    monkeypatch.setattr(http_guard, "REQUEST_READ_S", 30.0)
    with guarded(max_connections=2) as url, connect(url) as first, connect(url) as second:
        with caplog.at_level(logging.WARNING, logger=http_guard.__name__):
            for _ in range(3):
                with connect(url) as extra:
                    assert closed_within(extra, 5)
            time.sleep(0.6)  # the two held back are reported once the interval is over
        refused = [r.refused for r in caplog.records if r.getMessage() == "connections refused: too many open"]
        assert refused == [1, 2]
        assert not closed_within(first, 0.3)
        second.sendall(request(b"hello"))
        assert response(second).startswith(b"HTTP/1.1 200")


def test_accept_errors_become_one_line_per_interval_with_their_count(caplog, quick_warnings):
    """asyncio logged accept()'s EMFILE with a traceback for every attempt: 7,910 in a few seconds of one flood."""
    accept = "socket.accept() out of system resource"

    def record(message: str) -> logging.LogRecord:
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            return logging.getLogger("asyncio").makeRecord("asyncio", logging.ERROR, __file__, 1, message, (),
                                                            sys.exc_info())

    async def flood(errors: http_guard.AcceptErrorsOncePerMinute) -> list[bool]:
        passed = [errors.filter(record(accept)) for _ in range(4)]
        passed.append(errors.filter(record("Task exception was never retrieved")))  # anything else passes
        await asyncio.sleep(0.6)
        return passed

    with caplog.at_level(logging.ERROR, logger=http_guard.__name__):
        assert asyncio.run(flood(http_guard.AcceptErrorsOncePerMinute())) == [False] * 4 + [True]
    lines = [r for r in caplog.records if r.name == http_guard.__name__]
    assert [r.failures for r in lines] == [1, 3] and all(r.exc_info is None for r in lines)
    assert lines[0].getMessage().startswith("accept() ran out of open files")


class Clock:
    """Stands in for http_guard's `time` (monotonic() reads `now`) and for the running loop's call_later: the timers
    it is given run only at `advance`, once `now` reaches them."""

    def __init__(self) -> None:
        self.now = 0.0
        self.delays: list[float] = []  # of each call_later
        self.timers: list[tuple[asyncio.TimerHandle, Callable[[], None]]] = []

    def monotonic(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(self.now + delay, callback, (), asyncio.get_running_loop())
        self.delays.append(delay)
        self.timers.append((handle, callback))
        return handle

    def advance(self, to: float) -> None:
        """Sets `now` and runs the timers due by then that were not cancelled, in order."""
        self.now = to
        for handle, callback in sorted(self.timers, key=lambda timer: timer[0].when()):
            if handle.when() <= to:
                self.timers.remove((handle, callback))
                if not handle.cancelled():
                    callback()


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(http_guard, "time", clock)
    return clock


def test_throttled_holds_a_count_without_a_loop_until_the_next_event_after_the_interval(clock):
    """Outside a loop nothing flushes: the events held back are counted into the first line after the interval,
    with the event that writes it."""
    emitted: list[tuple[float, int]] = []
    throttled = http_guard.Throttled(lambda count: emitted.append((clock.now, count)))
    for now in (0, 1, 2, 60, 61, 119.5, 120):
        clock.advance(now)
        throttled()
    assert emitted == [(0, 1), (60, 3), (120, 3)]


def test_throttled_flushes_its_count_when_the_interval_since_the_last_line_ends(clock, monkeypatch):
    """In a loop the count held back is written WARN_EVERY_S (60 s) after the last line, by one timer however many
    events come. An event that finds the interval over before the loop ran that timer writes the count itself (its
    own included) and cancels the timer: run, it wrote the count of the events after it at once, a second line in
    the interval."""
    emitted: list[tuple[float, int]] = []

    async def events() -> None:
        monkeypatch.setattr(asyncio.get_running_loop(), "call_later", clock.call_later)
        throttled = http_guard.Throttled(lambda count: emitted.append((clock.now, count)))
        for now in (0, 10, 20):
            clock.advance(now)
            throttled()
        clock.advance(60)
        assert emitted == [(0, 1), (60, 2)] and clock.delays == [50]
        clock.advance(61)
        throttled()
        for now in (120, 120.5):  # the flush is due, but the loop runs these two events before it
            clock.now = now
            throttled()
        clock.advance(120.5)
        assert emitted == [(0, 1), (60, 2), (120, 2)]
        clock.advance(180.5)
        assert emitted == [(0, 1), (60, 2), (120, 2), (180.5, 1)] and clock.delays == [50, 59, 59.5]

    asyncio.run(events())
