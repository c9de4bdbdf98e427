"""The Ray that `music3serve serve --ray` (and the replica benchmark) runs the application on: the cluster at
RAY_ADDRESS, else a local one started and stopped here."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterator

from ray import serve

APP_NAME = "music3"


@contextlib.contextmanager
def on_ray(host: str, port: int) -> Iterator[None]:
    """Ray Serve with its HTTP proxy on host:port: on the cluster at RAY_ADDRESS (or the Ray this process already
    runs), else on a local Ray started here and stopped at the end. The application is deleted at the end, which
    drains its songs (shutdown_grace_s)."""
    import ray

    started = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        sigterm = signal.getsignal(signal.SIGTERM)
        ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level=logging.WARNING)
        if sigterm is not None and threading.current_thread() is threading.main_thread():  # Ray's dumps and aborts
            signal.signal(signal.SIGTERM, sigterm)  # the CLI's unwinds: the app deleted, Ray stopped, exit 143
    try:
        serve.start(http_options={"host": host, "port": port})  # a Serve already running keeps its own
        yield
    finally:
        with contextlib.suppress(Exception):  # the application may be gone already
            serve.delete(APP_NAME)
        if started:
            serve.shutdown()
            ray.shutdown()
