"""Waiting in tests for something another thread or process does: poll a condition up to a time limit."""

from __future__ import annotations

import threading
import time
from typing import Callable


def poll_until(condition: Callable[[], object], seconds: float = 30.0) -> None:
    """Return once condition() is true; fail the test if it is not within `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {seconds} s"
        time.sleep(0.01)


def hold(monkeypatch, owner: object, name: str) -> tuple[threading.Event, threading.Event]:
    """Make every call of owner.<name> (a method of a class too) wait, once it has started, until released (30 s at
    most): (started, release)."""
    real, started, release = getattr(owner, name), threading.Event(), threading.Event()

    def held(*args, **kwargs):
        started.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, held)
    return started, release
