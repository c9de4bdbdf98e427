"""The stage-1 worker process itself: it loads the acoustic stage, then renders the windows the engine sends until
told to stop, answering with PCM, failures and heartbeats (the split placement)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
from multiprocessing.synchronize import Semaphore
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
from tqdm import tqdm

from ..acoustic.payloads import RenderedWindow
from ..checkpoint import ACOUSTIC, load_component
from ..errors import error_text
from .connectors import ConnectorTimeout, LostMessage, Message, SharedMemoryConnector
from .deploy_config import Stage1Config
from .heartbeat import Heartbeat
from .render_loop import RenderLoop, stage1_renderer
from .worker_messages import PCM, WINDOWS, chunk_message, window_payload

log = logging.getLogger("music3serve.serving.worker")  # the worker's lines, under the name users filter on


def load_acoustic(root: str, device: str) -> SimpleNamespace:
    """Stage 1's components of the checkpoint at root, in float32 (the precision policy casts them)."""
    return SimpleNamespace(**{n: load_component(Path(root), n, device, torch.float32) for n in ACOUSTIC})


def use_thread_lock_for_progress_bars() -> None:
    """tqdm's default lock holds a multiprocessing semaphore, which a worker killed with SIGKILL cannot unregister
    (the resource tracker then warns of a leaked semaphore when the engine exits). The worker's bars need no lock
    shared between processes, only one between its threads."""
    tqdm.set_lock(threading.RLock())


def worker_main(load: Callable[[str], Any], device: str, stage1: Stage1Config, connector: SharedMemoryConnector,
                slots: Semaphore) -> None:
    """The worker process: load(device) the acoustic stage, then render windows until told to stop; each window read
    gives its slot back (serving/outbox.py).

    SIGTERM and SIGINT are ignored: a stop signal sent to the whole process group (systemd's default, `kill --
    -PGID`, Ctrl-C) reaches the worker too, and the engine process stops it after its own graceful shutdown (songs
    get their grace period). Orphaned, the worker stops by itself; `RenderWorker.kill` uses SIGKILL."""
    use_thread_lock_for_progress_bars()
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, signal.SIG_IGN)
    if device.startswith("cuda"):  # streams and graph captures belong to the worker's own GPU ("cuda" alone: 0)
        torch.cuda.set_device(torch.device(device).index or 0)
    try:
        renderer = stage1_renderer(load(device), stage1)
    except Exception as exc:  # the engine process says why, not only that the worker exited
        connector.put(PCM, Message("failed", {"error": error_text(exc)}, {}))
        raise
    connector.put(PCM, Message("ready", {}, {}))
    heartbeat = Heartbeat(lambda message: connector.put(PCM, message))
    parent = multiprocessing.parent_process()

    def inbox(block: bool) -> list[tuple]:
        if parent is not None and not parent.is_alive():  # orphaned (say the server got SIGKILL)
            log.warning("the engine process is gone; the stage-1 worker stops")
            connector.cleanup()  # nobody else is left to remove the segments
            return [("stop",)]
        items, wait = [], 0.05 if block else 0
        while True:
            try:
                message = connector.get(WINDOWS, wait)
            except ConnectorTimeout:
                return items
            except LostMessage as exc:  # a window whose segment vanished (say /dev/shm emptied): its song fails
                message = None
                slots.release()
                on_error(exc.meta["song"], f"stage 1 lost a window on its way: {exc}")
            wait = 0
            if message is None:
                continue
            if message.key == "window":
                items.append(("window", window_payload(message)))
                slots.release()
            else:
                items.append((message.key, message.meta.get("song")) if message.key == "cancel" else ("stop",))

    def on_chunk(out: RenderedWindow) -> None:
        connector.put(PCM, chunk_message(out))

    def on_error(song: str, message: str) -> None:
        connector.put(PCM, Message("failed", {"song": song, "message": message}, {}))

    try:
        RenderLoop(renderer, inbox, on_chunk, on_error, rendering=heartbeat.rendering).run()
    except Exception as exc:  # stage 1 stops (say its calls kept failing): the engine says why, not an exit code
        with contextlib.suppress(Exception):
            connector.put(PCM, Message("stopped", {"reason": error_text(exc)}, {}))
        raise
    finally:
        heartbeat.stop()
    connector.close()
