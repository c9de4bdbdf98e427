"""Who may use the HTTP API, and from where: API keys, the Host header (against DNS rebinding), CORS for browser
apps, and the Allow header of a 405. ASGI middleware, server-only like serving/api.py (docs/api.md, "Access")."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Iterator

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute, Match

from .error_bodies import error_reply_for, unknown_path

ASGIApp = Callable[..., Awaitable[None]]
OWNER = "music3serve.api_key"  # the scope key under which ApiKeys leaves the index of the request's key
PROTECTED = "/v1/"  # every route under it needs a key; /health, /metrics and /openapi.json stay open
# Answered whatever the Host header: probes and scrapers name the pod's address (Kubernetes, Prometheus), and these
# change nothing and show no song, so a page rebound to this server learns nothing from them.
ANY_HOST = ("/health", "/metrics")
# The response headers a browser app may read (CORS hides all but a few unless they are exposed).
EXPOSED_HEADERS = ("X-Song-Id", "X-Seed", "X-Frame-Budget", "X-Prompt-Tokens", "X-Sample-Rate", "X-Channels",
                   "X-Dropped-Lyrics-Lines", "Retry-After")
CORS_METHODS = ("GET", "HEAD", "POST", "DELETE")


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def route_path(scope: dict[str, Any]) -> str:
    """The request's path within the app: without the prefix it is mounted under (root_path, say a Ray Serve
    route_prefix), so /v1/ routes need a key wherever the app is mounted."""
    return scope["path"].removeprefix(scope.get("root_path", ""))


@dataclass(frozen=True)
class HostPolicy:
    """The Host header values a server answers. `loopback`: names and addresses of this machine's loopback
    (localhost, *.localhost, 127.0.0.0/8, ::1); `patterns`: names (case-insensitive), `*.example.com` (its
    subdomains) or `*` (any host)."""

    loopback: bool = False
    patterns: tuple[str, ...] = ("*",)

    @classmethod
    def for_bind(cls, bind: str, allowed: Iterable[str] = ()) -> "HostPolicy":
        """Bound to a loopback address: loopback names and addresses, and `allowed`. Bound elsewhere (all
        interfaces): `allowed` where given, else any host (probes and proxies reach it by names of their own)."""
        allowed = tuple(_host_name(a) for a in allowed)  # a port or an IPv6 address's brackets are no part of it
        if binds_loopback(bind):
            return cls(True, allowed)
        return cls(False, allowed or ("*",))

    def allows(self, host: str) -> bool:
        name = _host_name(host)
        if self.loopback and is_loopback(name):
            return True
        return any(p == "*" or (name and (p == name or (p.startswith("*.") and name.endswith(p[1:]))))
                   for p in self.patterns)


def binds_loopback(host: str) -> bool:
    """Whether a server bound to `host` listens on this machine's loopback alone, its address read as the socket layer
    reads it (127.1 and 2130706433 are 127.0.0.1)."""
    try:
        return is_loopback(host) or ipaddress.ip_address(socket.inet_aton(host)).is_loopback
    except OSError:  # not an IPv4 address in any of its forms
        return False


def is_loopback(name: str) -> bool:
    name = name.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: never resolved elsewhere
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


# A Host header value: an IPv6 address in brackets or a name (or IPv4 address), with an optional port of digits.
HOST_VALUE = re.compile(r"\[(?P<address>[^\]]*)\](?::[0-9]*)?|(?P<name>[^:\[\]]*)(?::[0-9]*)?")


def _host_name(host: str) -> str:
    """The name or address of a Host header value, without its port and an IPv6 address's brackets; "" (which only
    the pattern `*` allows) for a value of another form, such as an unclosed bracket or a port that is no number."""
    host = host.strip().lower()
    if host.count(":") > 1 and not host.startswith("["):  # an IPv6 address without its brackets
        return host
    match = HOST_VALUE.fullmatch(host)
    if match is None:
        return ""
    return match["address"] if match["address"] is not None else match["name"].rstrip(".")


@dataclass(frozen=True)
class Access:
    """The API's access settings (`serve --api-key`, `--allowed-origins`, `--allowed-hosts`); the defaults are an
    open API that answers any Host and no browser origin."""

    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    hosts: HostPolicy = HostPolicy()


class CheckHost:
    """ASGI middleware: a request whose Host header the policy does not allow is refused with 400, so a web page
    cannot reach a server on this machine through a name rebound to 127.0.0.1 (a request without one, HTTP/1.0, is
    no browser's and passes; so do the ANY_HOST paths). The refusal comes in the route's error body
    (serving/error_bodies.py)."""

    def __init__(self, app: ASGIApp, policy: HostPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and route_path(scope) not in ANY_HOST:
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if host is not None and not self.policy.allows(host):
                message = (f"the Host header {host!r:.80} is not one this server answers to (it protects against DNS "
                           "rebinding; name it with serve --allowed-hosts)")
                return await error_reply_for(route_path(scope))(400, message)(scope, receive, send)
        await self.app(scope, receive, send)


class ApiKeys:
    """ASGI middleware: every request under /v1/ needs `Authorization: Bearer KEY` with one of the keys (compared in
    constant time), else 401 in the route's error body (serving/error_bodies.py). The key's index is left in the
    scope (OWNER): a song belongs to the key that asked for it."""

    def __init__(self, app: ASGIApp, access: Access):
        self.app = app
        self.digests = [_digest(key.encode()) for key in access.api_keys]

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and route_path(scope).startswith(PROTECTED):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = header.partition(b" ")
            given = _digest(token.strip())
            matches = [hmac.compare_digest(given, digest) for digest in self.digests]  # every key, each in full
            if scheme.lower() != b"bearer" or True not in matches:
                message = ("this server needs an API key: send Authorization: Bearer <key>" if not header.strip()
                           else "the Authorization header must be Bearer <key>" if scheme.lower() != b"bearer"
                           else "the API key is empty: send Authorization: Bearer <key>" if not token.strip()
                           else "the API key is not valid")
                reply = error_reply_for(route_path(scope))
                return await reply(401, message, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            scope[OWNER] = matches.index(True)
        await self.app(scope, receive, send)


class Cors(CORSMiddleware):
    """Starlette's CORS for the `allowed` origins, with its refusals in the route's error body
    (serving/error_bodies.py): a preflight to a path no route has is a 404, one from an origin, or for a method, not
    allowed is a 400 that says which (naming the methods allowed, never the origins), as is one asking for access to a
    private network."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...], routes: list[BaseRoute]):
        super().__init__(app, allow_origins=allowed, allow_methods=CORS_METHODS, allow_headers=["*"],
                         expose_headers=EXPOSED_HEADERS)
        self.routes = routes  # the app's, filled in after the middleware is added

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "OPTIONS":  # lifespan and websocket scopes have no headers
            return await super().__call__(scope, receive, send)
        headers = Headers(scope=scope)
        if not ("origin" in headers and "access-control-request-method" in headers):
            return await super().__call__(scope, receive, send)
        reply = error_reply_for(route_path(scope))
        if next(_routes_at(self.routes, scope), None) is None:
            return await reply(404, unknown_path(scope["path"]))(scope, receive, send)
        response = self.preflight_response(headers)
        if response.status_code == 400:
            response = reply(400, self._refusal(headers), {"Vary": "Origin"})
        await response(scope, receive, send)

    def _refusal(self, headers: Headers) -> str:
        """Why a preflight was refused, and what is allowed."""
        origin, method = headers["origin"], headers["access-control-request-method"]
        if not self.is_allowed_origin(origin):
            return (f"browser pages from {origin!r:.80} may not call this server: its operator allows the origins "
                    "it serves (serve --allowed-origins)")  # not which ones: any page could read the list
        if method not in self.allow_methods:
            return f"a browser may not send {method!r:.20} here; the methods allowed are {', '.join(CORS_METHODS)}"
        return "a page on a public site may not call a server on a private network (Private Network Access)"


def cors_headers(access: Access, origin: str | None) -> dict[str, str]:
    """The CORS headers Cors gives an answer to `origin`, for one sent outside it (the 500 of an unexpected error,
    which Starlette's ServerErrorMiddleware sends from outside every middleware); none for an origin not allowed."""
    cors = Cors(None, access.allowed_origins, [])  # type: ignore[arg-type]  # never called: only its headers are read
    if origin is None or not access.allowed_origins or not cors.is_allowed_origin(origin):
        return {}
    return {**cors.simple_headers, "Access-Control-Allow-Origin": origin, "Vary": "Origin"}


def install(app: Any, access: Access) -> None:
    """Put the access checks in front of a FastAPI app's routes (after its other middleware, so outside it),
    outermost first: the Host header, CORS (a browser's preflight carries no key; a 401 needs CORS headers for the
    page to read it), then API keys."""
    if access.api_keys:
        app.add_middleware(ApiKeys, access=access)
    if access.allowed_origins:
        app.add_middleware(Cors, allowed=access.allowed_origins, routes=app.router.routes)
    if access.hosts.loopback or access.hosts.patterns != ("*",):
        app.add_middleware(CheckHost, policy=access.hosts)


def _routes_at(routes: Iterable[BaseRoute], scope: dict[str, Any]) -> Iterator[BaseRoute]:
    """The routes at the request's path, whatever their methods."""
    for route in routes:
        if route.matches({**scope, "method": "\0"})[0] is not Match.NONE:  # a method no route has: path matches only
            yield route


def allowed_methods(routes: Iterable[BaseRoute], scope: dict[str, Any]) -> str:
    """The Allow header of a 405: the methods of every route at the request's path (Starlette names only the first
    route's, and FastAPI makes one route per method)."""
    methods: set[str] = set()
    for route in _routes_at(routes, scope):
        methods |= getattr(route, "methods", None) or set()
    order = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return ", ".join(sorted(methods, key=lambda m: order.index(m) if m in order else len(order)))
