"""Structured logs: one line per event, `time level logger message key=value ...`."""

from __future__ import annotations

import logging

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}  # uvicorn adds the last


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        tail = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        return f"{line} {tail}" if tail else line


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
