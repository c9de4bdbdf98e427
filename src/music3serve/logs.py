"""Structured logs: one line per event, `time level logger message key=value ...` (time in UTC, ISO 8601)."""

from __future__ import annotations

import logging
import sys
import time
import unicodedata

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}  # uvicorn adds the last


class KeyValueFormatter(logging.Formatter):
    """The record's extra fields as logfmt after the message: None is left out, a value with a space, quote, equals
    sign, backslash or control character is quoted and escaped, and the message's control characters are escaped,
    so each event stays one line that parses back (a traceback still follows on lines of its own)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _one_line(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = {k: v for k, v in vars(record).items()  # "_" names: other libraries' own (Ray's record factory)
                  if k not in _STANDARD and not k.startswith("_") and v is not None}
        tail = " ".join(f"{k}={_value(v)}" for k, v in fields.items())
        return f"{line} {tail}" if tail else line


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _visible(c: str) -> str:
    """A control or line-separating character (tab, line feed, ESC, NUL, U+0085, U+2028...) as its escape in Python's
    notation, any other character as itself."""
    if unicodedata.category(c) not in ("Cc", "Zl", "Zp"):
        return c
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def _one_line(text: str) -> str:
    return "".join(map(_visible, text))


def _value(value: object) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    if text and not any(c in ' "=\\' or _visible(c) != c for c in text):
        return text
    return '"' + _one_line(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


class StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when a record comes, not when it was made: a server thread that logs
    after stderr was swapped (a test's captured stream closed, a redirect) writes to the current one."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _: object) -> None:
        pass


def setup_logging(level: str = "INFO") -> None:
    """Every logger's records to stderr as key=value lines stamped like 2026-12-02T14:33:04.814Z."""
    formatter = KeyValueFormatter("%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s %(message)s", "%Y-%m-%dT%H:%M:%S")
    formatter.converter = time.gmtime
    handler = StderrHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
