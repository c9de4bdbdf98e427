"""The API server's HTTP protocol (serving/http_guard.py): a client that never finishes its request loses its
connection after REQUEST_READ_S, and connections past the cap are closed at once; whole requests are untouched."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time

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
