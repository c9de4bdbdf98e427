"""The stage-1 worker's pulse and the engine's watch over it: a frozen or stuck worker is told from a busy one."""

from __future__ import annotations

import threading
import time
from typing import Callable

from .connectors import Message

HEARTBEAT_S = 1.0  # the worker's pulse
SILENCE_LIMIT_S = 30.0  # no pulse this long: the worker process is frozen (its pulse thread cannot run)
# One render call this long, times its Euler-step scale (steps / 30), is stuck: eight windows at 30 steps take
# ~3.5 s on an H200.
RENDER_LIMIT_S = 120.0
PAUSE_S = 5.0  # a gap this much longer than expected in a beat or a check: this process itself was paused


class Heartbeat:
    """In the worker: a thread that says every HEARTBEAT_S how long the render loop has been in its current render
    call and that call's Euler-step scale. Time the whole process spends paused (say a frozen container) is not
    counted as rendering."""

    def __init__(self, say: Callable[[Message], None], period_s: float = HEARTBEAT_S):
        self.say, self.period_s = say, period_s
        self._busy: tuple[float, float] | None = None  # (since, scale) while a render call runs
        self._stop = threading.Event()
        threading.Thread(target=self._beat, name="music3-stage1-heartbeat", daemon=True).start()

    def rendering(self, scale: float | None) -> None:
        """A render call of this Euler-step scale starts; None: it ended."""
        self._busy = None if scale is None else (time.monotonic(), scale)

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.period_s):
            now, busy = time.monotonic(), self._busy
            if busy is not None and now - last > self.period_s + PAUSE_S:  # paused: shift the call's start
                self._busy = busy = (busy[0] + now - last - self.period_s, busy[1])
            last = now
            meta = {"busy_s": 0.0, "scale": 1.0} if busy is None else {"busy_s": now - busy[0], "scale": busy[1]}
            try:
                self.say(Message("alive", meta, {}))
            except Exception:  # the connector is closed: the worker is stopping
                return


class WorkerWatch:
    """In the engine: what the worker's messages say of it, and whether it is hung."""

    def __init__(self, silence_s: float = SILENCE_LIMIT_S, render_s: float = RENDER_LIMIT_S):
        self.silence_s, self.render_s = silence_s, render_s
        self.heard = time.monotonic()
        self._checked: float | None = None
        self.busy_s, self.scale = 0.0, 1.0

    def heard_from(self, message: Message) -> None:
        self.heard = time.monotonic()
        if message.key == "alive":
            self.busy_s, self.scale = float(message.meta["busy_s"]), float(message.meta["scale"])

    def hung(self) -> str | None:
        """Why the worker counts as hung, or None. Checked often: the silence counts from the first check on (the
        engine may start long after its worker), and after a gap in the checks (this process was paused) the
        worker gets a fresh allowance."""
        now = time.monotonic()
        if self._checked is None or now - self._checked > PAUSE_S:
            self.heard = now
        self._checked = now
        if now - self.heard > self.silence_s:
            return f"said nothing for {now - self.heard:.0f} s"
        if self.busy_s > self.render_s * self.scale:
            return f"has been in one render call for {self.busy_s:.0f} s"
        return None
