"""The serve command's access values: API keys (flags and MUSIC3_API_KEY), browser origins and Host names, each
read as argparse types (and by the Ray application's arguments) before anything heavy is imported."""

from __future__ import annotations

import argparse
import os

from .errors import Music3Error


def api_key(value: str) -> str:
    """An API key: printable ASCII without spaces or commas (it travels in an HTTP header; commas separate keys)."""
    if not value or not all("!" <= c <= "~" for c in value) or "," in value:
        raise argparse.ArgumentTypeError("an API key is printable ASCII without spaces or commas")
    return value


DEFAULT_PORTS = {"http": ":80", "https": ":443"}


def origin(value: str) -> str:
    """A browser origin (scheme://host[:port], no path), or * for any; written as browsers send it (CORS compares the
    strings): lower case, without the scheme's default port."""
    value = value.rstrip("/").removesuffix(":")  # an empty port is no port
    scheme, sep, rest = value.partition("://")
    if value != "*" and not (sep and scheme.isascii() and scheme.isalpha() and rest
                             and not any(c in rest for c in "/?# ")):
        raise argparse.ArgumentTypeError(f"{value!r} is not an origin: scheme://host[:port] (say "
                                         "https://app.example.com or http://localhost:3000) or *")
    if value == "*":
        return value
    if "*" in rest:  # CORS matches origins whole: a pattern would never match a page
        raise argparse.ArgumentTypeError(f"{value!r}: an origin is matched whole, with no patterns: name each one "
                                         "(https://a.example.com, https://b.example.com), or * for any")
    scheme, rest = scheme.lower(), rest.lower()
    port = DEFAULT_PORTS.get(scheme)
    return f"{scheme}://{rest.removesuffix(port) if port else rest}"


def host_name(value: str) -> str:
    """A Host header name to answer: a name or address, *.example.com for its subdomains, or * for any."""
    if not value.isascii() or any(c.isspace() or c in "/@?#" for c in value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a host name (say music.example.com, *.example.com or *)")
    return value


def env_api_keys() -> list[str]:
    """MUSIC3_API_KEY: one or more comma-separated keys; unset: none. Set but holding no key (empty, or only commas
    and blanks) is refused: that is almost always a secret that did not arrive, and would leave the server open."""
    value = os.environ.get("MUSIC3_API_KEY")
    if value is None:
        return []
    if not value.replace(",", "").strip():
        raise Music3Error("MUSIC3_API_KEY is set but holds no key (did its secret arrive?): give it one or more "
                          "comma-separated keys, or unset it to serve without keys")
    try:
        return [api_key(key.strip()) for key in value.split(",") if key.strip()]
    except argparse.ArgumentTypeError as exc:
        raise Music3Error(f"MUSIC3_API_KEY: {exc}") from None
