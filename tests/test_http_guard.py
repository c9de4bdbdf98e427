"""The API server's HTTP protocol (serving/http_guard.py): a client that never finishes its request loses its
connection after REQUEST_READ_S, and connections past the cap are closed at once; whole requests are untouched."""

from __future__ import annotations

import logging
import socket
import sys
import time

import pytest

pytest.importorskip("uvicorn")

from music3serve.serving import http_guard  # noqa: E402 (after the skip: it imports uvicorn)


async def echo(scope, receive, send) -> None:
    """Answers every request with its body."""
    assert scope["type"] == "http"
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
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


def request(body: bytes) -> bytes:
    return b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def response(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    data = b""
    while not data.endswith(b"hello"):
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


def test_connections_past_the_cap_are_closed_at_once(guarded, monkeypatch, caplog):
    monkeypatch.setattr(http_guard, "REQUEST_READ_S", 30.0)
    monkeypatch.setattr(http_guard._Refusals, "last_warning", float("-inf"))
    with guarded(max_connections=2) as url, connect(url) as first, connect(url) as second:
        with caplog.at_level(logging.WARNING, logger=http_guard.__name__):
            for _ in range(3):
                with connect(url) as extra:
                    assert closed_within(extra, 5)
        assert [r.getMessage() for r in caplog.records] == ["connections refused: too many open"]  # once a minute
        assert not closed_within(first, 0.3)
        second.sendall(request(b"hello"))
        assert response(second).startswith(b"HTTP/1.1 200")


def test_accept_errors_are_logged_once_a_minute_with_the_count_held_back():
    """asyncio logged accept()'s EMFILE with a traceback for every attempt: 7,910 in a few seconds of one flood."""
    log = logging.getLogger("asyncio")
    accept = "socket.accept() out of system resource"

    def record(message: str) -> logging.LogRecord:
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            return log.makeRecord("asyncio", logging.ERROR, __file__, 1, message, (), sys.exc_info())

    errors = http_guard.AcceptErrorsOncePerMinute()
    first = record(accept)
    assert errors.filter(first) and first.exc_info is None and "0 such errors held back" in first.getMessage()
    assert [errors.filter(record(accept)) for _ in range(3)] == [False] * 3
    assert errors.filter(record("Task exception was never retrieved"))  # anything else passes untouched
    errors.last -= http_guard.WARN_EVERY_S
    later = record(accept)
    assert errors.filter(later) and "3 such errors held back" in later.getMessage()
