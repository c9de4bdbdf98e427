"""The guard of an engine's stage threads: a stage loop that dies, or a call the watch finds hung, stops the engine
serving, and every song it holds fails with the reason instead of waiting forever."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from ..errors import Music3Error, error_text
from .heartbeat import PAUSE_S, StageWatch
from .stage1 import Stage1

log = logging.getLogger("music3serve.serving.engine")  # the engine's lines, under the name users filter on


class StageGuard:
    """The stage threads' wrapper (`guarded`) and the watch thread's loop (`watch_loop`); `broken` says why the engine
    stopped serving, `hung_stage` which stage's thread the watch found stuck in one call."""

    def __init__(self, device: torch.device, stage_watches: dict[str, StageWatch], stage1: Stage1,
                 stop: threading.Event, fail_all: Callable[[str], None]):
        """stage_watches: the stage threads of this process, by stage name; stop: set when the engine closes;
        fail_all(reason): fail every song the engine holds."""
        self.device, self.stage_watches, self.stage1, self.stop, self.fail_all = (
            device, stage_watches, stage1, stop, fail_all)
        self.broken: str | None = None  # why a stage thread died; the engine then refuses work
        self.hung_stage: str | None = None
        self._lock = threading.Lock()

    def guarded(self, loop: Callable[[], None]) -> None:
        """Run a stage loop; if it dies, every open stream fails with the reason instead of waiting forever."""
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            loop()
        except BaseException as exc:
            if isinstance(exc, Music3Error):  # a stop the stage names itself (say its worker died): one line
                log.error("engine stage stopped", extra={"stage": threading.current_thread().name, "error": str(exc)})
            else:
                log.exception("engine thread died")
            self.stop_serving(f"engine stage stopped ({threading.current_thread().name}): {error_text(exc)}")

    def stop_serving(self, reason: str) -> None:
        """The engine cannot serve any more: every song it holds fails with the reason, and so does every submit."""
        with self._lock:  # the first reason stands (the stage-1 threads may both see a worker that is gone)
            self.broken = self.broken or reason
        self.fail_all(self.broken)

    # The watch: of the stage threads here for a call that never ends, and of stage 1's own needs (the worker).
    def watch_loop(self) -> None:
        last = time.monotonic()
        # Once the engine is broken (say a stage thread died, mid-call: that is no hang) there is nothing left to watch.
        while not self.stop.wait(0.05) and self.stage1.loss is None and self.broken is None:
            now = time.monotonic()
            if now - last > PAUSE_S:  # this process was paused: that time counts for no call and no song's wait
                for watch in self.stage_watches.values():
                    watch.paused(now - last)
                self.stage1.paused()
            last = now
            for stage, watch in self.stage_watches.items():
                hung = watch.hung()
                if hung is not None:  # its thread cannot be stopped: the engine stops serving, /health says why
                    log.error("%s %s: the engine stops serving", stage, hung)
                    self.hung_stage = stage
                    self.stop_serving(f"{stage} {hung} and counts as hung; restart the engine's process")
                    return
            self.stage1.check()
