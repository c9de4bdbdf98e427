"""Waiting in tests for something another thread or process does: poll a condition up to a time limit."""

from __future__ import annotations

import time
from typing import Callable


def poll_until(condition: Callable[[], object], seconds: float = 30.0) -> None:
    """Return once condition() is true; fail the test if it is not within `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {seconds} s"
        time.sleep(0.01)
