"""Stage 1's work loop, the same in a thread beside the talker and in a separate worker process."""

from __future__ import annotations

import logging
from collections import defaultdict, deque
from typing import Any, Callable, Iterable

import torch

from .. import contract
from ..acoustic.payloads import RenderedWindow, WindowPayload
from ..acoustic.precision import PrecisionPolicy
from ..acoustic.renderer import Renderer
from ..errors import Music3Error, NonFiniteAudio, error_text
from ..memory import GIB, card_share, host_memory, module_bytes
from .deploy_schema import Stage1Config

log = logging.getLogger(__name__)


def stage1_renderer(models: Any, stage1: Stage1Config) -> Renderer:
    """Stage 1's renderer as the deploy config describes it (models: its three components, loaded in float32), its
    weights checked against its memory share, its graphs captured and its first window rendered. On CUDA its
    elementwise chains are fused (inductor) with or without graphs, in a worker of its own as beside the talker,
    whose process fuses everything it runs. The cached blocks nobody uses (the talker's warm-up) go back to the driver
    first: on a small card the warm-up's vocoder calls need large blocks that those could not serve."""
    renderer = Renderer.from_models(
        models, PrecisionPolicy.named(stage1.precision), graphs=stage1.graphs, max_batch=stage1.render_batch, fuse=True,
    )
    check_weights_fit(renderer, stage1.gpu_memory_utilization)
    if renderer.device.type == "cuda":
        with torch.cuda.device(renderer.device):
            torch.cuda.empty_cache()
    renderer.warmup(stage1.compilation_config.cudagraph_capture_sizes)
    return renderer


def check_weights_fit(renderer: Renderer, share: float) -> None:
    """Stage 1's weights, in the dtypes of its precision policy, must fit in its gpu_memory_utilization of the card
    (on the CPU: in the machine's memory), or startup fails with the numbers. The activations of a render batch and
    the graphs' memory come on top and are not measured."""
    modules = (renderer.encoder, renderer.dit, renderer.vocoder)
    weights = module_bytes(*modules)
    advice = ["run stage 1 in bfloat16"] if renderer.policy.name == "float32" else []
    if renderer.device.type == "cuda":
        (allowed, where), advice = card_share(renderer.device, share), ["raise it", *advice]
    else:
        allowed = host_memory()
        where = f"this machine's {allowed / GIB:.1f} GiB of memory"
    if weights > allowed:
        raise Music3Error(f"stage 1 needs {weights / GIB:.1f} GiB of {renderer.policy.name} weights, more than "
                          f"{where}" + (f": {' or '.join(advice)}" if advice else ""))


def delivery_failed(out: RenderedWindow, exc: Exception) -> str:
    """Log why a rendered window could not be handed on, with the traceback; the failure message of its song (that
    song alone fails, in either placement)."""
    log.exception("delivering window %d of %s failed", out.window.index, out.song)
    return f"stage 1 could not deliver window {out.window.index}: {error_text(exc)}"


# An inbox item: ("window", WindowPayload) | ("cancel", song) | ("stop",)
Inbox = Callable[[bool], Iterable[tuple]]

# A stage whose calls fail this many times in a row, each failing its songs, stops instead: the device, not a song, is
# at fault (say a sticky CUDA error), and a stopped stage makes the engine unavailable (HTTP /health 503) so that it
# gets restarted, where it would otherwise fail every song it takes while it looks healthy.
FAILED_CALLS_BEFORE_STOP = 3


class RenderLoop:
    """Windows queue per song; each render call takes the next window of up to max_batch songs."""

    def __init__(
        self,
        renderer: Renderer,
        inbox: Inbox,
        on_chunk: Callable[[RenderedWindow], None],
        on_error: Callable[[str, str], None],
        rendering: Callable[[float | None], None] = lambda work: None,
    ):
        """`rendering(work)` is told when a render call starts, its work counted in windows of the contract's 30
        Euler steps (windows x max(1, steps / 30): a call renders one step count), and `rendering(None)` when it
        ends (the worker's heartbeat reports it)."""
        self.renderer, self.inbox, self.on_chunk, self.on_error = renderer, inbox, on_chunk, on_error
        self.rendering = rendering
        self.pending: dict[str, deque[WindowPayload]] = defaultdict(deque)
        # Songs failed here: their windows still in flight are dropped until the engine's cancel arrives (they
        # would otherwise reach the renderer out of order and fail the songs batched with them).
        self.failed: set[str] = set()
        self.failures_in_a_row = 0  # single-window render calls

    def run(self) -> None:
        """Until a ("stop",) item arrives."""
        while True:
            for item in self.inbox(not self.pending):  # block only when there is nothing to render
                if item[0] == "stop":
                    return
                if item[0] == "window" and item[1].song not in self.failed:
                    self.queue(item[1])
                elif item[0] == "cancel":
                    self.failed.discard(item[1])
                    self.pending.pop(item[1], None)
                    self.renderer.cancel(item[1])
            songs = list(self.pending)[: self.renderer.max_batch]
            batch = [self.pending[song].popleft() for song in songs]
            for song in songs:  # round robin: served songs go to the back of the line
                queue = self.pending.pop(song)
                if queue:
                    self.pending[song] = queue
            if batch:
                self.render(batch)

    def queue(self, payload: WindowPayload) -> None:
        """Queue a window after its song's last one; a window out of order fails its song alone (batched, the
        renderer would refuse the whole call)."""
        queued = self.pending.get(payload.song)
        if queued and queued[-1].window.last:
            self.fail(payload.song, f"stage 1 got window {payload.window.index} of song {payload.song!r} after its "
                                    f"last window {queued[-1].window.index}")
            return
        expected = queued[-1].window.index + 1 if queued else self.renderer.next_index(payload.song)
        if payload.window.index != expected:
            self.fail(payload.song, f"stage 1 got window {payload.window.index} of song {payload.song!r} where "
                                    f"window {expected} was due (an earlier one was lost)")
            return
        self.pending[payload.song].append(payload)

    def render(self, batch: list[WindowPayload]) -> None:
        """One render call per Euler-step count, fewest steps first, each delivered before the next renders: a
        song asking for many steps holds the others' windows for its own render only, not for each one it is
        batched with."""
        by_steps: dict[int, list[WindowPayload]] = defaultdict(list)
        for payload in batch:
            by_steps[payload.steps].append(payload)
        for steps in sorted(by_steps):
            self.render_group(by_steps[steps])

    def render_group(self, batch: list[WindowPayload]) -> None:
        """Render windows of one step count and hand each on. A failed call of several windows is made again one
        window at a time (a failed call leaves the renderer's songs as they were), so that a window that cannot
        render fails its song alone, never the loop."""
        try:
            rendered = self.render_call(batch)
        except Exception as exc:
            if len(batch) == 1:
                self.fail(batch[0].song, f"stage 1 failed: {error_text(exc)}")
                if isinstance(exc, NonFiniteAudio):  # the call ran, the window's content is at fault (the same
                    log.error("render failed: %s", exc)  # request sent again fails again), not the device: no trace
                    return
                log.exception("render failed")
                self.failures_in_a_row += 1
                if self.failures_in_a_row >= FAILED_CALLS_BEFORE_STOP:
                    raise Music3Error(f"stage 1 failed {self.failures_in_a_row} windows in a row (the last: "
                                      f"{error_text(exc)}); "
                                      "it stops") from exc
                return
            log.warning("a render of %d windows failed (%r); rendering them one at a time", len(batch), exc)
            rendered = None
        if rendered is None:  # out of the except block: the failed call's tensors are freed first
            for payload in batch:
                self.render_group([payload])
            return
        self.failures_in_a_row = 0
        for out in rendered:
            try:
                self.on_chunk(out)
            except Exception as exc:  # say the connector could not take it: this song only
                self.fail(out.song, delivery_failed(out, exc))

    def render_call(self, batch: list[WindowPayload]) -> list[RenderedWindow]:
        """One render call, reported to `rendering` while it runs."""
        self.rendering(len(batch) * max(1.0, batch[0].steps / contract.DIT_STEPS))
        try:
            return self.renderer.render(batch)
        finally:
            self.rendering(None)

    def fail(self, song: str, message: str) -> None:
        self.failed.add(song)
        self.pending.pop(song, None)
        self.renderer.cancel(song)
        self.on_error(song, message)
