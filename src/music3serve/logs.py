"""Structured logs: one line per event, `time level logger message key=value ...`."""

from __future__ import annotations

import logging

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}  # uvicorn adds the last


class KeyValueFormatter(logging.Formatter):
    """The record's extra fields as logfmt after the message: None is left out, a value with a space, quote, equals
    sign or line break is quoted and escaped, so each event stays one line that parses back."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = {k: v for k, v in vars(record).items() if k not in _STANDARD and v is not None}
        tail = " ".join(f"{k}={_value(v)}" for k, v in fields.items())
        return f"{line} {tail}" if tail else line


def _value(value: object) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    if text and not any(c in text for c in ' "=\\\n\r\t'):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
