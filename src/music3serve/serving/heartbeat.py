"""The stage-1 worker's pulse and the engine's watch over it (a frozen or stuck worker is told from a busy one), and
the watch over the stage threads of the engine's own process."""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

from .connectors import Message

HEARTBEAT_S = 1.0  # the worker's pulse
SILENCE_LIMIT_S = 30.0  # no pulse this long: the worker process is frozen (its pulse thread cannot run)
# A render call longer than this per window of its batch (times the Euler-step scale, steps / 30) is stuck. One
# window of 30 steps takes ~0.4 s in bf16 and ~5.2 s in IEEE float32 on an H200 (DiT calls and vocoder,
# docs/performance.md): room for a GPU ten times slower.
RENDER_LIMIT_PER_WINDOW_S = 60.0
# A talker frame step (or prefill chunk) longer than this is stuck: a step takes ~7 ms on an H200, a prefill chunk
# well under a second, and a shape the compiled hot paths have not seen yet compiles in seconds to tens of seconds.
TALKER_STEP_LIMIT_S = 120.0
TALKER_CALL = "talker call (a frame step, its windows' hand-over, or taking a song)"
RENDER_CALL = "render call ({work:g} windows' work)"  # what a stage-1 call is called in the reasons given
PAUSE_S = 5.0  # a gap this much longer than expected between beats or checks: this process itself was paused


def hang_limit(device_type: str, limit_s: float) -> float:
    """The limit for a stage on this kind of device: the GPU limits above guard against a wait on a GPU that never
    answers; on the CPU there is none (a full-size model's prefill or render call takes minutes there: slow, not
    stuck)."""
    return limit_s if device_type == "cuda" else math.inf


class Heartbeat:
    """In the worker: a thread that says every HEARTBEAT_S how long the render loop has been in its current render
    call and that call's work (windows x Euler-step scale). Time the whole process spends paused (say a frozen
    container) does not count as rendering."""

    def __init__(self, say: Callable[[Message], None], period_s: float = HEARTBEAT_S):
        self.say, self.period_s = say, period_s
        self._call: tuple[float, float] | None = None  # (start, work) while a render call runs
        self._stop = threading.Event()
        threading.Thread(target=self._beat, name="music3-stage1-heartbeat", daemon=True).start()

    def rendering(self, work: float | None) -> None:
        """A render call of this much work starts; None: it ended."""
        self._call = None if work is None else (time.monotonic(), work)

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        last, current, paused = time.monotonic(), None, 0.0  # paused: seconds of the current call spent paused
        while not self._stop.wait(self.period_s):
            now, call = time.monotonic(), self._call
            if call is not current:
                current, paused = call, 0.0
            excess = now - last - self.period_s
            if call is not None and excess > PAUSE_S:
                # The beat wakes right after a pause ends, and nothing runs during one: a call started after the
                # pause is only moments old here, a call that spanned it at least the pause's length.
                paused += max(0.0, min(excess, now - call[0] - self.period_s))
            last = now
            busy = 0.0 if call is None else max(0.0, now - call[0] - paused)
            try:
                self.say(Message("alive", {"busy_s": busy, "work": 0.0 if call is None else call[1]}, {}))
            except Exception:  # the connector is closed: the worker is stopping
                return


class WorkerWatch:
    """In the engine: what the worker's messages say of it, and whether it is hung."""

    def __init__(self, silence_s: float = SILENCE_LIMIT_S, render_s: float = RENDER_LIMIT_PER_WINDOW_S):
        self.silence_s, self.render_s = silence_s, render_s
        self.heard = time.monotonic()
        self._checked: float | None = None
        self.busy_s, self.work = 0.0, 0.0

    def heard_from(self, message: Message) -> None:
        self.heard = time.monotonic()
        if message.key == "alive":
            self.busy_s, self.work = float(message.meta["busy_s"]), float(message.meta["work"])

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
        if self.work and self.busy_s > self.render_s * self.work:
            return f"has been in one {RENDER_CALL.format(work=self.work)} for {self.busy_s:.0f} s"
        return None


class StageWatch:
    """A stage thread of the engine's own process: it reports its calls to `busy(work)` (None when one ends), and the
    engine's watch loop asks `hung()`: a call past `limit_s` per unit of work counts as hung. The watch loop reports
    the time this process spent paused (`paused`), which does not count. A thread cannot be stopped from outside;
    the engine fails the songs it holds and stops taking more (HTTP /health 503)."""

    def __init__(self, limit_s: float, call: str):
        """`call` names what the calls do, with `{work}` where their work goes."""
        self.limit_s, self.call = limit_s, call
        self._call: tuple[float, float] | None = None  # (start, work) while a call runs
        self._lock = threading.Lock()

    def busy(self, work: float | None) -> None:
        """A call of this much work starts; None: it ended."""
        with self._lock:
            self._call = None if work is None else (time.monotonic(), work)

    def paused(self, seconds: float) -> None:
        """This process was paused this long: the current call's clock moves on by as much."""
        with self._lock:
            if self._call is not None:
                self._call = (self._call[0] + seconds, self._call[1])

    def hung(self) -> str | None:
        call = self._call
        if call is None:
            return None
        busy = time.monotonic() - call[0]
        if busy > self.limit_s * call[1]:
            return f"has been in one {self.call.format(work=call[1])} for {busy:.0f} s"
        return None
