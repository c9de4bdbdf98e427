"""Stage 1 as the engine sees it: the renderer on a thread of the engine's process (colocated), or a worker process
reached through the connector (split). Either takes windows and cancels from the talker's thread, runs `run` on a
thread of its own, and hands rendered windows and failed songs back through the engine's callbacks."""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from typing import Callable, NoReturn

import torch

from ..acoustic.payloads import RenderedWindow, WindowPayload
from ..acoustic.renderer import Renderer
from ..errors import Music3Error
from .connector_base import ConnectorError, LostMessage, PeerGone
from .heartbeat import StageWatch
from .render_loop import RenderLoop, delivery_failed
from .worker import RenderWorker
from .worker_messages import chunk_window

OnChunk = Callable[[RenderedWindow], None]
OnError = Callable[[str, str], None]  # (song key, message): the song fails, and is cancelled everywhere


class Stage1(ABC):
    """What the engine asks of either placement; the hooks a placement has no use for do nothing."""

    def __init__(self, on_chunk: OnChunk, on_error: OnError, closing: threading.Event):
        self.on_chunk, self.on_error, self._closing = on_chunk, on_error, closing
        self.loss: str | None = None  # why stage 1 is gone for good (the split worker died or hung)

    @abstractmethod
    def send(self, payload: WindowPayload, ready: torch.cuda.Event | None) -> None:
        """Hand on a window whose conditioning the talker stream finishes writing at `ready` (None on the CPU)."""

    @abstractmethod
    def cancel(self, key: str) -> None:
        """The song is cancelled: its windows not yet rendered are dropped."""

    def stop(self) -> None:
        """The engine is closing: `run` returns soon."""

    @abstractmethod
    def run(self) -> None:
        """Stage 1's own thread, until the engine closes."""

    def drop_waits(self, key: str) -> None:
        """The song is cancelled: nothing it has sent is waited for any more."""

    def check(self) -> None:
        """Called often by the engine's watch loop."""

    def paused(self) -> None:
        """This process was paused: waits start again."""

    def close(self) -> None:
        """After the talker thread is joined (or given up on as stuck), before stage 1's thread is joined."""


class LocalStage1(Stage1):
    """The renderer on a thread of this process: windows cross an in-process queue with the CUDA event of the talker
    step that wrote them, so the renderer never reads conditioning the talker stream has not finished writing."""

    def __init__(self, renderer: Renderer, on_chunk: OnChunk, on_error: OnError, closing: threading.Event,
                 watch: StageWatch):
        super().__init__(on_chunk, on_error, closing)
        self.renderer, self.watch = renderer, watch
        self.windows: queue.Queue = queue.Queue()

    def send(self, payload: WindowPayload, ready: torch.cuda.Event | None) -> None:
        self.windows.put(("window", payload, ready))

    def cancel(self, key: str) -> None:
        self.windows.put(("cancel", key))

    def stop(self) -> None:
        self.windows.put(("stop",))

    def run(self) -> None:
        RenderLoop(self.renderer, self._take, self.on_chunk, self.on_error, rendering=self.watch.busy).run()

    def _take(self, block: bool) -> list[tuple]:
        """Everything queued (waiting up to 50 ms if asked to block); stop once closing."""
        stream, items = self.renderer.stream, []  # the renderer's own stream (its graphs were captured on it)
        try:
            items.append(self.windows.get(timeout=0.05) if block else self.windows.get_nowait())
            while True:
                items.append(self.windows.get_nowait())
        except queue.Empty:
            pass
        for item in items:
            if item[0] == "window" and item[2] is not None:  # the talker stream's writes come first
                stream.wait_event(item[2])
                item[1].mixed.record_stream(stream)
        if self._closing.is_set():
            items.append(("stop",))
        return [item[:2] for item in items]


class WorkerStage1(Stage1):
    """Stage 1 in a worker process: windows leave through the worker's outbox, its PCM and failure reports come
    back to `run` (the receiver), and `check` (the engine's watch loop, apart from the receiver, so that a read stuck
    in a frozen worker's half-sent message is no matter) fails the songs past their connector waits and stops a
    worker that hangs."""

    def __init__(self, worker: RenderWorker, device: torch.device, on_chunk: OnChunk, on_error: OnError,
                 closing: threading.Event):
        super().__init__(on_chunk, on_error, closing)
        self.worker = worker
        # Windows leave through a copy on a side stream, which waits only for the step that wrote them, not for the
        # step the talker has queued since.
        self._copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Lock()

    def send(self, payload: WindowPayload, ready: torch.cuda.Event | None) -> None:
        """To the worker's outbox (its writer thread reports a window the connector cannot take, say /dev/shm is
        full, to `check`, which fails that song only)."""
        if self._copies is None:
            self.worker.send_window(payload)
            return
        if ready is not None:
            self._copies.wait_event(ready)
        with torch.cuda.stream(self._copies):
            self.worker.send_window(payload)  # its device-to-host copy runs here

    def cancel(self, key: str) -> None:
        self.worker.send_cancel(key)
        self.drop_waits(key)  # a window handed on while the cancel waited started waits nobody would answer

    def drop_waits(self, key: str) -> None:
        self.worker.deadlines.drop(key)

    def close(self) -> None:
        self.worker.close()  # before the receiver is joined: one stuck in a frozen worker's half-sent message is freed

    def paused(self) -> None:
        self.worker.deadlines.restart()

    def run(self) -> None:
        while not self._closing.is_set():
            try:
                message = self.worker.receive(0.05)
            except PeerGone:  # no sender left, after everything it sent was read
                if self._closing.is_set():
                    return
                self.lost()
            except LostMessage as exc:  # one message without its payload: its song alone fails
                if "song" in exc.meta:
                    self.on_error(exc.meta["song"], f"stage 1's audio was lost on its way: {exc}")
                continue
            except ConnectorError:  # the connector closed under it: the engine is closing
                if self._closing.is_set():
                    return
                raise
            if message is None:
                continue
            if message.key == "chunk":
                self.deliver(chunk_window(message))
            elif message.key == "failed":
                self.on_error(message.meta["song"], message.meta["message"])
            elif message.key == "stopped":  # its last word before it exits (say its calls kept failing)
                if self._closing.is_set():
                    return
                self.lost(f"the stage-1 worker stopped: {message.meta['reason']}")

    def deliver(self, out: RenderedWindow) -> None:
        """Hand a rendered window on; one that cannot be fails its song alone, as in the colocated RenderLoop (the
        receiver goes on)."""
        try:
            self.on_chunk(out)
        except Exception as exc:
            self.on_error(out.song, delivery_failed(out, exc))

    def check(self) -> None:
        waits = self.worker.deadlines
        for key in waits.overdue():
            self.on_error(key, "stage 1 sent no audio within the connector wait "
                               f"({waits.first_chunk_s:g} s first, {waits.later_s:g} s later)")
        for key, reason in self.worker.outbox.failures():  # windows the connector could not take
            self.on_error(key, reason)
        hung = self.worker.watch.hung()
        if hung is not None:  # (or dead, its pipe held open by something it left behind)
            alive = self.worker.alive()
            self.lost(f"the stage-1 worker {hung} and was stopped as hung" if alive else None)

    def lost(self, reason: str | None = None) -> NoReturn:
        """Stop (or reap) the worker and stop the calling thread with the reason (by default: it died), the same
        whichever thread sees the loss first: a worker stopped as hung is not reported as died when its pipe
        closes."""
        with self._lock:
            if reason is not None and self.loss is None:
                self.loss = reason
        self.worker.kill()  # what waited for it dropped, its segments removed
        with self._lock:
            self.loss = self.loss or f"the stage-1 worker died (exit code {self.worker.process.exitcode})"
        raise Music3Error(self.loss)
