"""The size of a POST body, checked before anything reads it: a length given (411 else), not in chunks, within
MAX_BODY_BYTES (413 else); a refused body is read and dropped before the answer where that keeps the connection
usable (docs/api.md)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from .error_bodies import BODY_PATHS, error_reply_for

# Far above a request at the caption and lyrics limits (25,000 characters, at most 4 UTF-8 bytes each).
MAX_BODY_BYTES = 1 << 20
# A refused body up to this size is read and dropped before its 411 or 413 is sent. A client that sends its whole
# body before it reads the answer (httpx does) needs the connection open until it has: a server that closes it with
# request bytes still unread makes its kernel reset the connection, and the client loses the answer ("connection
# reset by peer"). Four times the limit covers a body too big by a mistake of degree (lyrics pasted twice);
# dropping it holds little memory (uvicorn stops reading while 64 KiB wait) and takes no longer than the server's
# read deadline (http_guard.REQUEST_READ_S). A larger body is answered at once and its connection closed.
DRAIN_BYTES = 4 * MAX_BODY_BYTES

# A chunked body refused beside a Content-Length closes its connection (RFC 9112 6.1): the server would otherwise
# frame the next request where a proxy that trusted the Content-Length did not.
CLOSE = {"Connection": "close"}


def _at_most(digits: str, limit: int) -> bool:
    """Whether a decimal count without leading zeros is at most `limit` (by length first: int() refuses over 4300
    digits)."""
    return len(digits) <= len(str(limit)) and int(digits) <= limit


def too_large(digits: str) -> str:
    """The 413's message for a body of `digits` bytes (a decimal count without leading zeros)."""
    shown = digits if len(digits) <= 20 else f"{digits[:20]}... ({len(digits)} digits)"
    return f"the body is {shown} bytes; the limit is {MAX_BODY_BYTES} bytes"


def _expects_continue(scope: dict[str, Any]) -> bool:
    """Whether the client waits to be told to send its body (Expect: 100-continue): reading it would tell it to."""
    return any(name == b"expect" and b"100-continue" in value.lower() for name, value in scope["headers"])


async def _drop_body(receive: Callable, limit: int) -> bool:
    """Reads the request's body, keeping none of it: whether it all came within `limit` bytes."""
    read = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left
            return False
        read += len(message.get("body", b""))
        if read > limit:
            return False
        if not message.get("more_body", False):
            return True


class BoundedBody:
    """ASGI middleware: a POST body is read whole before it is parsed, so it must say its length (else 411),
    not come in chunks (a Transfer-Encoding overrides the Content-Length beside it, so the length would bound
    nothing: 411 too) and stay within MAX_BODY_BYTES (else 413); other POSTs without a length go on to the router's
    404 or 405. A refused body is read and dropped before the answer (up to DRAIN_BYTES), unless the client waits
    for a 100 Continue. Plain ASGI, so streamed responses pass through untouched."""

    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            error_response = error_reply_for(scope["path"].removeprefix(scope.get("root_path", "")))
            headers = dict(scope["headers"])
            length = headers.get(b"content-length", b"").decode("latin-1")
            chunked = b"transfer-encoding" in headers
            if not length or chunked:
                path = scope["path"].removeprefix(scope.get("root_path", ""))  # the app may be mounted under a prefix
                if path not in BODY_PATHS:  # a body the router refuses (404 / 405) without reading it
                    return await self.app(scope, receive, send)
                message = "send the body with a Content-Length header"
                if chunked:
                    message += ", not in chunks (Transfer-Encoding)"
                    if not _expects_continue(scope):
                        await _drop_body(receive, DRAIN_BYTES)  # the answer closes: unread bytes would reset it
                return await error_response(411, message, CLOSE if chunked else None)(scope, receive, send)
            if not (length.isascii() and length.isdigit()):  # "²".isdigit() too, and int() refuses it
                message = f"Content-Length {length!r:.40} is not a byte count"
                return await error_response(400, message)(scope, receive, send)
            digits = length.lstrip("0") or "0"
            if not _at_most(digits, MAX_BODY_BYTES):
                message = too_large(digits)
                droppable = _at_most(digits, DRAIN_BYTES)
                if droppable and not _expects_continue(scope) and await _drop_body(receive, DRAIN_BYTES):
                    return await error_response(413, message)(scope, receive, send)
                # The body stays unread (too big to drop, or the client holds it back for a 100 Continue): the
                # answer closes the connection, which would otherwise wait for it or read and drop all of it.
                return await error_response(413, message, CLOSE)(scope, receive, send)
        await self.app(scope, receive, send)
