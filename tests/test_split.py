"""The split placement: stage 1 in a worker process behind the shared-memory connector."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterable

import numpy as np
import pytest
import torch

from music3serve.acoustic.payloads import WindowPayload
from music3serve.acoustic.windows import Window
from music3serve.checkpoint import load_models
from music3serve.errors import Music3Error
from music3serve.serving import worker_process
from music3serve.serving.connectors import ConnectorError, ConnectorTimeout, LostMessage, Message
from music3serve.serving.engine import Engine
from music3serve.serving.events import AudioChunk, Failed, SongRequest
from music3serve.serving import heartbeat
from music3serve.serving.deploy_config import load_deploy_config
from music3serve.serving.heartbeat import HEARTBEAT_S, RENDER_LIMIT_PER_WINDOW_S, Heartbeat, WorkerWatch, hang_limit
from music3serve.serving.outbox import Outbox
from music3serve.serving.stage1 import WorkerStage1
from music3serve.serving.worker import ChunkDeadlines, RenderWorker, windows_in_flight
from music3serve.serving.worker_messages import PCM, WINDOWS, window_message
from music3serve.serving.worker_process import load_acoustic
from polling import poll_until  # tests/ is on the import path (no package)
from shm_names import segments
from test_engine import wait_until  # the engine tests' helper

SONGS = [(0, 6.0), (1, 9.0), (2, 4.0)]
# Split vs colocated PCM, max abs: windows of different songs can share a render batch in one run and not the other,
# and float32 batching rounds differently, amplified by the tiny random vocoder: measured 2.2e-5 .. 6.4e-5 here, and
# 7.4e-5 at worst over eight concurrent songs (tests/test_engine.py). 1.5e-4 is twice that; the PCM crossing the
# connector in float16 (2.4e-4 on these ~0.6 peaks) or any lossier copy fails it, as 1e-3 did not.
SPLIT_PCM_MAX_ABS = 1.5e-4


async def song_pcm(engine: Engine, seed: int, duration: float) -> np.ndarray | str:
    chunks = []
    async for event in engine.submit(SongRequest(f"pop {seed}", "[verse]\nla la", duration, seed=seed, steps=2)):
        if isinstance(event, AudioChunk):
            chunks.append(event.pcm)
        elif isinstance(event, Failed):
            return event.message
    return np.concatenate(chunks, axis=-1)


def run_songs(engine: Engine) -> list:
    async def all_songs():
        return await asyncio.wait_for(asyncio.gather(*(song_pcm(engine, s, d) for s, d in SONGS)), 240)

    return asyncio.run(all_songs())


@pytest.fixture(scope="module")
def colocated(tiny_dir):
    engine = Engine.from_pretrained(tiny_dir, device="cpu")
    yield run_songs(engine)
    engine.close()


SPLIT_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deploy" / "split.yaml"


def test_the_split_example_places_stage_1_on_the_second_gpu(monkeypatch):
    """examples/deploy/split.yaml: on a machine with two GPUs the engine puts stage 1 on cuda:1, in a worker."""
    from music3serve.serving.stage_devices import stage_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    deploy = load_deploy_config(SPLIT_EXAMPLE)
    assert stage_devices(deploy, None) == ("cuda:0", "cuda:1")
    assert deploy.stages[0] == load_deploy_config().stages[0]  # not listed: the defaults


def test_split_layout_gives_the_colocated_pcm_and_leaves_no_segments(tiny_dir, colocated):
    """Through examples/deploy/split.yaml (on the CPU, split as on two GPUs)."""
    engine = Engine.from_pretrained(tiny_dir, load_deploy_config(SPLIT_EXAMPLE), device="cpu", split=True)
    try:
        connector = engine.worker.connector
        split = run_songs(engine)
    finally:
        engine.close()
    for a, b in zip(split, colocated):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype == np.float32 and a.shape == b.shape, a
        assert np.abs(a - b).max() < SPLIT_PCM_MAX_ABS  # float32 batching differences only
    assert not segments(connector)


def test_a_killed_worker_fails_its_songs_clearly_and_leaves_no_segments(tiny_dir, caplog):
    caplog.set_level("ERROR", logger="music3serve.serving.engine")
    engine = Engine.from_pretrained(tiny_dir, device="cpu", split=True)
    connector = engine.worker.connector
    try:

        async def scenario():
            stream = engine.submit(SongRequest("pop", "[verse]\nla", 30.0, seed=4, steps=2))
            events = []
            async for event in stream:
                events.append(event)
                if isinstance(event, AudioChunk) and event.window == 0:
                    os.kill(engine.worker.process.pid, signal.SIGKILL)
            return events

        events = asyncio.run(asyncio.wait_for(scenario(), 240))
        assert isinstance(events[-1], Failed) and "worker died" in events[-1].message
        with pytest.raises(Music3Error, match="worker died"):
            asyncio.run(song_pcm(engine, 5, 2.0))
    finally:
        engine.close()
    assert not segments(connector)
    stopped = [r for r in caplog.records if r.name == "music3serve.serving.engine"]
    assert stopped and all(r.getMessage() == "engine stage stopped" and not r.exc_info for r in stopped), [
        (r.getMessage(), r.exc_info) for r in stopped]  # the death is one line, not a traceback
    assert "worker died" in stopped[0].error


def test_a_stop_signal_to_the_process_group_leaves_the_worker_to_the_engine(tiny_dir):
    """SIGTERM and SIGINT sent to the whole group (systemd's default stop) reach the worker too: it keeps serving, so
    the engine's own graceful shutdown decides when it stops (it died at once, cutting every song)."""
    engine = Engine.from_pretrained(tiny_dir, device="cpu", split=True)
    try:
        for stop_signal in (signal.SIGTERM, signal.SIGINT):
            os.kill(engine.worker.process.pid, stop_signal)
        result = asyncio.run(asyncio.wait_for(song_pcm(engine, 7, 2.0), 120))
        assert isinstance(result, np.ndarray) and result.size, result
        assert engine.worker.process.is_alive()
    finally:
        engine.close()
    assert not engine.worker.process.is_alive()


def test_a_process_that_never_closes_its_split_engine_still_exits(tiny_dir, tmp_path):
    """The worker ignores SIGTERM, which multiprocessing sends its daemon children at interpreter exit before waiting
    for them: an engine never closed is killed at exit instead of the process hanging there."""
    import subprocess
    import sys

    script = tmp_path / "no_close.py"
    script.write_text(
        "from music3serve.serving.engine import Engine\n"
        "if __name__ == '__main__':\n"
        f"    engine = Engine.from_pretrained({str(tiny_dir)!r}, device='cpu', split=True)\n"
        "    print(engine.worker.process.pid, flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    worker = int(done.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


def test_stage1_silence_fails_the_song_after_the_connector_wait(tiny_dir):
    engine = Engine.from_pretrained(tiny_dir, device="cpu", split=True)
    engine.worker.deadlines.first_chunk_s = 0.3  # the seed's 30 s first-chunk wait, shortened for the test
    os.kill(engine.worker.process.pid, signal.SIGSTOP)  # alive but silent
    try:
        result = asyncio.run(asyncio.wait_for(song_pcm(engine, 6, 2.0), 120))
        assert isinstance(result, str) and "no audio within the connector wait" in result
    finally:
        os.kill(engine.worker.process.pid, signal.SIGCONT)
        engine.close()


def test_a_frozen_worker_is_stopped_as_hung_and_the_engine_says_so(tiny_dir):
    """Alive but frozen past the silence limit (its heartbeat stops too): the worker is killed, the song in flight
    fails with the reason, the engine refuses songs and says why, close() does not wait on it, and nothing is left
    in /dev/shm."""
    engine = Engine.from_pretrained(tiny_dir, device="cpu", split=True)
    connector = engine.worker.connector
    try:

        async def scenario():
            events = []
            async for event in engine.submit(SongRequest("pop", "[verse]\nla", 30.0, seed=4, steps=2)):
                events.append(event)
                if isinstance(event, AudioChunk) and event.window == 0:
                    os.kill(engine.worker.process.pid, signal.SIGSTOP)
                    engine.worker.watch.silence_s = 1.0  # the default 30 s, shortened for the test
            return events

        events = asyncio.run(asyncio.wait_for(scenario(), 240))
        assert isinstance(events[-1], Failed), events[-1]
        assert "said nothing for" in events[-1].message and "stopped as hung" in events[-1].message
        assert "stopped as hung" in engine.unavailable()
        assert not engine.worker.alive()
        with pytest.raises(Music3Error, match="stopped as hung"):
            asyncio.run(song_pcm(engine, 5, 2.0))
    finally:
        started = time.monotonic()
        engine.close()
        assert time.monotonic() - started < 20
    assert not segments(connector)


def test_an_idle_worker_is_not_taken_for_hung(tiny_dir):
    """Between songs the worker's heartbeat goes on, so a silence limit shorter than the idle time kills nothing."""
    engine = Engine.from_pretrained(tiny_dir, device="cpu", split=True)
    try:
        engine.worker.watch.silence_s = 3.0
        time.sleep(5)
        assert engine.unavailable() is None and engine.worker.alive()
        assert isinstance(asyncio.run(asyncio.wait_for(song_pcm(engine, 7, 2.0), 120)), np.ndarray)
    finally:
        engine.close()


def test_the_heartbeat_reports_the_render_call_and_the_watch_tells_stuck_from_long():
    said = []
    beat = Heartbeat(said.append, period_s=0.05)
    try:
        time.sleep(0.2)
        assert said and said[-1].meta == {"busy_s": 0.0, "work": 0.0}
        beat.rendering(10.0)  # a call of ten windows' work starts
        time.sleep(0.3)
        busy = said[-1].meta
        assert 0.1 < busy["busy_s"] < 1.0 and busy["work"] == 10.0
        beat.rendering(None)
        time.sleep(0.2)
        assert said[-1].meta["busy_s"] == 0.0
    finally:
        beat.stop()

    watch = WorkerWatch(silence_s=30.0, render_s=2.0)
    watch.heard -= 100  # before the first check (the engine starting): not counted
    assert watch.hung() is None
    watch.heard_from(Message("alive", {"busy_s": 15.0, "work": 10.0}, {}))
    assert watch.hung() is None  # 15 s of ten windows' work: within 2 s x 10
    watch.heard_from(Message("alive", {"busy_s": 25.0, "work": 10.0}, {}))
    assert watch.hung() == "has been in one render call (10 windows' work) for 25 s"
    watch.heard_from(Message("alive", {"busy_s": 0.0, "work": 0.0}, {}))
    assert watch.hung() is None
    watch.silence_s, watch.heard = 1.0, time.monotonic() - 2.0
    assert watch.hung().startswith("said nothing for 2")
    watch._checked -= 10  # this process was paused itself: the worker gets a fresh allowance
    assert watch.hung() is None


@pytest.mark.parametrize("device, hung", [("cuda", True), ("cpu", False)])
def test_a_call_counts_as_hung_past_its_limit_on_a_gpu_only(device, hung):
    """A full-size model's render call takes minutes on the CPU: slow, not stuck (the limits guard against a GPU
    wait that never returns)."""
    watch = WorkerWatch(render_s=hang_limit(device, RENDER_LIMIT_PER_WINDOW_S))
    assert watch.hung() is None
    watch.heard_from(Message("alive", {"busy_s": 100 * RENDER_LIMIT_PER_WINDOW_S, "work": 1.0}, {}))
    assert (watch.hung() is not None) == hung


def test_time_the_worker_spends_paused_is_not_rendering(monkeypatch):
    """A frozen process (say a paused container) resumes: neither a call started after the pause nor one that
    spanned it counts the pause as rendering time."""
    clock = [1000.0]
    monkeypatch.setattr(heartbeat, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    said = []
    beat = Heartbeat(said.append, period_s=0.02)
    try:
        time.sleep(0.1)
        clock[0] += 100  # paused while idle
        time.sleep(0.1)
        beat.rendering(1.0)
        clock[0] += 2
        time.sleep(0.1)
        assert said[-1].meta["busy_s"] == pytest.approx(2.0)
        clock[0] += 100  # paused in the middle of the call
        time.sleep(0.1)
        assert 2.0 <= said[-1].meta["busy_s"] < 3.0
        beat.rendering(None)
        time.sleep(0.1)
        clock[0] += 100  # paused while idle, and a call starts before the beat has seen the pause
        beat.rendering(1.0)
        time.sleep(0.1)  # (the beat wakes right after a pause: its wait is long over)
        clock[0] += 3
        time.sleep(0.1)
        assert said[-1].meta["busy_s"] == pytest.approx(3.0)
    finally:
        beat.stop()


def stalling_loader(root: str, flag: str, device: str) -> SimpleNamespace:
    """Stage 1's models whose vocoder does not return while `flag` exists (a render call that hangs, the GIL
    free, as in a wait for a stuck GPU)."""
    models = load_acoustic(root, device)
    forward = models.vocoder.forward

    def stalled(*args, **kwargs):
        while os.path.exists(flag):
            time.sleep(0.05)
        return forward(*args, **kwargs)

    models.vocoder.forward = stalled
    return models


def engine_with_loader(tiny_dir, loader, shm_threshold_bytes: int | None = None) -> Engine:
    """A split engine whose worker loads stage 1 with `loader(device)` (and, if given, sends payloads of this many
    bytes or more through shared memory)."""
    deploy = load_deploy_config()
    connector = deploy.connector
    if shm_threshold_bytes is not None:
        connector = replace(connector, extra=replace(connector.extra, shm_threshold_bytes=shm_threshold_bytes))
    models = load_models(tiny_dir, device="cpu", talker_dtype=torch.float32, acoustic=False)
    return Engine(models, deploy, RenderWorker(loader, "cpu", deploy.stages[1], connector))


def stalling_engine(tiny_dir, flag) -> Engine:
    return engine_with_loader(tiny_dir, partial(stalling_loader, str(tiny_dir), str(flag)))


def assert_that_song_alone_fails(engine: Engine, reason: str) -> None:
    """Song 1 fails with `reason`; the engine and its worker go on, and song 2 completes."""
    result = asyncio.run(asyncio.wait_for(song_pcm(engine, 1, 6.0), 120))
    assert isinstance(result, str) and reason in result
    assert engine.unavailable() is None and engine.worker.alive()
    assert isinstance(asyncio.run(asyncio.wait_for(song_pcm(engine, 2, 6.0), 120)), np.ndarray)


def failing_loader(root: str, device: str) -> SimpleNamespace:
    """Stage 1's models whose every render call fails (as on a device with a sticky error)."""
    models = load_acoustic(root, device)

    def gone(*args, **kwargs):
        raise RuntimeError("injected sticky device error")

    models.dit.forward = gone
    return models


def test_a_worker_whose_calls_keep_failing_stops_and_the_engine_says_why(tiny_dir):
    """Three failed windows in a row stop stage 1 (render_loop.FAILED_CALLS_BEFORE_STOP): the engine's reason is
    the worker's own, not only that it exited with code 1."""
    engine = engine_with_loader(tiny_dir, partial(failing_loader, str(tiny_dir)))
    try:
        for seed in range(3):
            result = asyncio.run(asyncio.wait_for(song_pcm(engine, seed, 2.0), 120))
            assert isinstance(result, str) and "injected sticky device error" in result
        asyncio.run(wait_until(lambda: engine.unavailable() is not None, "stage 1 stops"))
        reason = engine.unavailable()  # the messages alone, no exception reprs or class names
        assert "the stage-1 worker stopped: stage 1 failed 3 windows in a row (the last: injected sticky" in reason
        assert "exit code" not in engine.unavailable()
        with pytest.raises(Music3Error, match="stage 1 failed 3 windows in a row"):
            asyncio.run(song_pcm(engine, 3, 2.0))
    finally:
        engine.close()


def test_a_worker_that_cannot_start_says_why(tiny_dir):
    """Stage 1's startup checks run in the worker: the engine said only that the worker exited with code 1, the
    reason (here its memory check's numbers) went to the worker's stderr."""
    deploy = load_deploy_config()
    stage1 = replace(deploy.stages[1], dtype="bfloat16")
    loader = partial(load_acoustic, str(tiny_dir))
    with pytest.raises(Music3Error, match=r"the stage-1 worker could not start: stage 1 needs .* GiB of "
                                          r"bfloat16 weights, more than this machine's"):
        RenderWorker(partial(small_machine_loader, loader), "cpu", stage1, deploy.connector)


def small_machine_loader(loader, device: str) -> SimpleNamespace:
    """`loader`'s models in a worker whose machine has 1 KB of memory (as stage 1's memory check sees it)."""
    from music3serve.serving import render_loop

    render_loop.host_memory = lambda: 1 << 10
    return loader(device)


def test_a_render_call_that_never_ends_is_stopped_as_hung(tiny_dir, tmp_path):
    flag = tmp_path / "stall"
    flag.touch()
    engine = stalling_engine(tiny_dir, flag)
    engine.worker.watch.render_s = 2.0  # per window of work; the default 60 s, shortened for the test
    connector = engine.worker.connector
    try:
        result = asyncio.run(asyncio.wait_for(song_pcm(engine, 1, 6.0), 120))
        assert isinstance(result, str) and "has been in one render call" in result and "stopped as hung" in result
        assert "stopped as hung" in engine.unavailable()
    finally:
        flag.unlink()
        engine.close()
    assert not segments(connector)


def test_a_long_render_call_does_not_time_out_the_songs_waiting_on_it(tiny_dir, tmp_path):
    """A render call longer than the connector wait (float32 on a slow GPU): the worker says it is rendering, so the
    waiting song's clock restarts and it completes. The wait is 2.5 heartbeats: the first beat of the call comes up to
    one heartbeat after the window is sent (at 1 heartbeat, the CI failed when a beat came a little late)."""
    flag = tmp_path / "stall"
    flag.touch()
    engine = stalling_engine(tiny_dir, flag)
    engine.worker.deadlines.first_chunk_s = engine.worker.deadlines.later_s = 2.5 * HEARTBEAT_S
    try:
        threading.Timer(7.5 * HEARTBEAT_S, flag.unlink).start()  # the call takes three times the wait
        assert isinstance(asyncio.run(asyncio.wait_for(song_pcm(engine, 2, 6.0), 120)), np.ndarray)
    finally:
        engine.close()


class GatedConnector:
    """Records what is written; the first write waits until `release` (a worker slow to read)."""

    def __init__(self, fail_windows: bool = False):
        self.entered, self.release, self.written = threading.Event(), threading.Event(), []
        self.fail_windows = fail_windows

    def put(self, channel, message):
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(30)
        if self.fail_windows and message.key == "window":
            raise ConnectorError("no space left in /dev/shm")
        self.written.append((message.key, message.meta.get("song"), message.meta.get("index")))


def window(song: str, index: int) -> Message:
    return Message("window", {"song": song, "index": index}, {})


def cancel(song: str) -> Message:
    return Message("cancel", {"song": song}, {})


def test_the_outbox_never_blocks_and_skips_the_windows_of_a_song_cancelled_behind_them():
    gated = GatedConnector()
    outbox = Outbox(gated, "windows")
    outbox.put(window("a", 0))
    assert gated.entered.wait(5)  # the writer is on it, held there until the release below
    started = time.monotonic()
    for message in [window("a", 1), window("b", 0), cancel("a"), window("b", 1)]:
        outbox.put(message)
    for i in range(2, 500):  # a burst (async_chunk false: a whole song's windows at its end)
        outbox.put(window("b", i))
    # The talker never waits for the worker: a put that did would wait for ever here (the writer is held); the
    # bound only keeps a failure from hanging, with room for a loaded machine (CI's two cores ran 1.8 s to the wait).
    assert time.monotonic() - started < 5.0
    gated.release.set()
    outbox.put(Message("stop", {}, {}))
    assert outbox.join(10)
    # the cancel goes out ahead of the windows queued before it; a's queued window is dropped
    assert gated.written[:4] == [("window", "a", 0), ("cancel", "a", None), ("window", "b", 0), ("window", "b", 1)]
    assert gated.written[4:] == [("window", "b", i) for i in range(2, 500)] + [("stop", None, None)]
    assert outbox.failures() == []


def test_closing_the_outbox_drops_the_queued_windows_but_sends_the_stop():
    gated = GatedConnector()
    outbox = Outbox(gated, "windows")
    outbox.put(window("a", 0))
    assert gated.entered.wait(5)  # being written
    outbox.put(window("a", 1))
    outbox.close(Message("stop", {}, {}))
    gated.release.set()
    assert outbox.join(10)
    assert gated.written == [("window", "a", 0), ("stop", None, None)]


def test_windows_wait_for_a_slot_the_reader_gives_back_and_a_cancel_frees_the_waiting_ones():
    """At most `slots` windows written and unread (in /dev/shm); the rest wait in the outbox until the reader gives a
    slot back; a window still waiting when its song is cancelled is never written."""
    gated = GatedConnector()
    gated.release.set()
    slots = threading.Semaphore(2)
    outbox = Outbox(gated, "windows", slots)
    for i in range(4):
        outbox.put(window("a", i))
    outbox.put(window("b", 0))
    time.sleep(0.3)
    assert gated.written == [("window", "a", 0), ("window", "a", 1)]
    slots.release()  # the reader took window 0
    time.sleep(0.3)
    assert gated.written[-1] == ("window", "a", 2)
    outbox.put(cancel("a"))  # window 3 is waiting for a slot: the cancel goes out now, window 3 is dropped
    time.sleep(0.3)
    assert gated.written[3:] == [("cancel", "a", None)]
    slots.release()
    time.sleep(0.3)
    assert gated.written[4:] == [("window", "b", 0)]
    outbox.put(window("b", 1))  # no slot left: waits
    outbox.close(Message("stop", {}, {}))  # closing drops it
    assert outbox.join(5)
    assert gated.written[-1] == ("stop", None, None) and ("window", "b", 1) not in gated.written


def test_windows_the_connector_cannot_take_come_back_once_as_failures_of_their_songs():
    gated = GatedConnector(fail_windows=True)
    gated.release.set()
    outbox = Outbox(gated, "windows")
    for message in [window("a", 3), window("a", 4), cancel("b"), Message("stop", {}, {})]:
        outbox.put(message)
    assert outbox.join(10)  # it ends after the stop
    assert outbox.failures() == [("a", "stage 1 could not take window 3: no space left in /dev/shm")]
    assert gated.written == [("cancel", "b", None), ("stop", None, None)]  # window 4 skipped, not failed again
    assert outbox.failures() == []


class Recorder:
    """A connector that records what is written at once; windows of the songs in `refuse` fail (say /dev/shm full)."""

    def __init__(self, refuse: Iterable[str] = ()):
        self.refuse, self.written = set(refuse), []

    def put(self, channel, message):
        if message.key == "window" and message.meta["song"] in self.refuse:
            raise ConnectorError("no space left in /dev/shm")
        self.written.append((message.key, message.meta.get("song"), message.meta.get("index")))


class Slots(threading.Semaphore):
    """The outbox's slots, noting when the writer waited for one in vain (a window is waiting for the reader)."""

    def __init__(self, value: int):
        super().__init__(value)
        self.waited = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        got = super().acquire(blocking, timeout)
        if not got:
            self.waited.set()
        return got


class CancellingSlots:
    """Slots whose first acquire comes only after `song` was cancelled meanwhile (the talker's cancel racing the
    slot); `taken` counts the slots held."""

    def __init__(self, song: str):
        self.song, self.outbox, self.taken = song, None, 0

    def acquire(self, timeout: float | None = None) -> bool:
        if self.song is not None:
            self.outbox.put(cancel(self.song))
            self.song = None
        self.taken += 1
        return True

    def release(self) -> None:
        self.taken -= 1


def test_a_window_the_connector_refused_gives_its_slot_back():
    """A window write that fails frees its slot: with a single slot, the next song's window is still written."""
    connector = Recorder(refuse={"a"})
    outbox = Outbox(connector, "windows", threading.Semaphore(1))
    outbox.put(window("a", 0))
    outbox.put(window("b", 0))
    poll_until(lambda: ("window", "b", 0) in connector.written, 2.0)
    outbox.close(Message("stop", {}, {}))
    assert outbox.join(5)
    assert [song for song, _ in outbox.failures()] == ["a"]


def test_a_cancel_goes_out_while_another_songs_window_waits_for_a_slot():
    """Slots used up and a window of b waiting for one: a cancel of a is written at once, before b gets a slot (the
    worker stops rendering a, which frees the slot)."""
    connector, slots = Recorder(), Slots(1)
    outbox = Outbox(connector, "windows", slots)
    outbox.put(window("a", 0))  # takes the slot; the worker, busy rendering, has not read it
    outbox.put(window("b", 0))
    assert slots.waited.wait(5)  # b's window is waiting for the slot
    outbox.put(cancel("a"))
    poll_until(lambda: ("cancel", "a", None) in connector.written, 2.0)
    assert connector.written == [("window", "a", 0), ("cancel", "a", None)]
    slots.release()  # the worker read a's window
    poll_until(lambda: ("window", "b", 0) in connector.written, 2.0)
    outbox.close(Message("stop", {}, {}))
    assert outbox.join(5)


def test_a_window_cancelled_while_it_waited_for_its_slot_is_not_written_and_the_slot_goes_back():
    """The cancel came while the writer waited for a slot, and the slot came after: the window is dropped, its slot
    given back, and the cancel and the other songs' windows still go out."""
    connector, slots = Recorder(), CancellingSlots("a")
    outbox = Outbox(connector, "windows", slots)
    slots.outbox = outbox
    outbox.put(window("a", 0))
    outbox.put(window("b", 0))
    outbox.put(Message("stop", {}, {}))
    assert outbox.join(5)
    assert connector.written == [("cancel", "a", None), ("window", "b", 0), ("stop", None, None)]
    assert slots.taken == 1  # b's, which the worker gives back once it reads it


def test_one_window_slot_still_gives_the_colocated_songs_and_every_slot_back(tiny_dir, colocated, monkeypatch):
    """The worker reads one window at a time (the outbox waits for it to give the slot back): the songs are the
    colocated ones, and afterwards the slot is free and /dev/shm empty."""
    from music3serve.serving import worker

    monkeypatch.setattr(worker, "windows_in_flight", lambda render_batch: 1)
    engine = Engine.from_pretrained(tiny_dir, device="cpu", split=True)
    connector, slots = engine.worker.connector, engine.worker.outbox.slots
    try:
        for got, want in zip(run_songs(engine), colocated):
            assert got.shape == want.shape and np.abs(got - want).max() < SPLIT_PCM_MAX_ABS
        assert slots.get_value() == 1
    finally:
        engine.close()
    assert not segments(connector)


def first_segment_gone(read):
    """shm_segments.read_segment as if the first segment read had been removed before (say by RemoveIPC)."""
    reads = []

    def first_one_gone(name, reader):
        reads.append(name)
        if len(reads) == 1:
            raise FileNotFoundError(name)
        return read(name, reader)

    return first_one_gone


def losing_loader(root: str, device: str) -> SimpleNamespace:
    """Stage 1's models, in a worker where the first window's shared-memory segment is gone before it is read."""
    from music3serve.serving import shm_segments

    shm_segments.read_segment = first_segment_gone(shm_segments.read_segment)
    return load_acoustic(root, device)


def test_a_window_whose_segment_vanished_fails_its_song_alone(tiny_dir):
    # The tiny model's windows are small: through shared memory too, so that one can go missing.
    engine = engine_with_loader(tiny_dir, partial(losing_loader, str(tiny_dir)), shm_threshold_bytes=0)
    try:
        assert_that_song_alone_fails(engine, "lost a window on its way")
    finally:
        engine.close()


def test_audio_whose_segment_vanished_fails_its_song_alone(tiny_dir, monkeypatch):
    """A PCM chunk whose shared-memory segment is gone before it is read (say /dev/shm emptied by RemoveIPC): that
    song fails with the reason; the worker and the next song are fine."""
    from music3serve.serving import shm_segments

    engine = Engine.from_pretrained(tiny_dir, device="cpu", split=True)
    monkeypatch.setattr(shm_segments, "read_segment", first_segment_gone(shm_segments.read_segment))
    try:
        assert_that_song_alone_fails(engine, "audio was lost on its way")
    finally:
        engine.close()


@pytest.mark.parametrize("split", [True, False], ids=["split", "colocated"])
def test_a_window_that_cannot_be_delivered_fails_its_song_alone_in_either_placement(tiny_dir, monkeypatch, split):
    """The engine's hand-over of a rendered window raises (here its first one's): that song fails saying so, and the
    engine serves on. Split, the receiver thread died of it and the engine stopped."""
    from music3serve.serving.stage_reports import StageReports

    real, calls = StageReports.on_chunk, []

    def first_one_fails(self, out):
        calls.append(out.song)
        if len(calls) == 1:
            raise RuntimeError("the chunk could not be queued")
        return real(self, out)

    monkeypatch.setattr(StageReports, "on_chunk", first_one_fails)  # before the engine binds it
    engine = Engine.from_pretrained(tiny_dir, device="cpu", split=split)
    try:
        result = asyncio.run(asyncio.wait_for(song_pcm(engine, 1, 6.0), 120))
        assert result == "stage 1 could not deliver window 0: the chunk could not be queued"
        assert engine.unavailable() is None and (not split or engine.worker.alive())
        assert isinstance(asyncio.run(asyncio.wait_for(song_pcm(engine, 2, 6.0), 120)), np.ndarray)
    finally:
        engine.close()


def test_a_song_with_more_euler_steps_gets_proportionally_longer_connector_waits():
    """Its render takes that much longer: with the contract's 30 steps the first-chunk wait is as configured, with
    300 steps ten times as long, and so are the waits of songs with windows out beside it (they may be batched
    with it, or queued behind its render call)."""
    waits = ChunkDeadlines(first_chunk_s=0.2, later_s=0.1)
    waits.sent("alone")
    time.sleep(0.3)
    assert waits.overdue() == ["alone"]
    waits.sent("plain")
    waits.sent("heavy", steps=300)
    waits.sent("heavy", steps=300)  # a second window out
    time.sleep(0.3)
    assert waits.overdue() == []  # plain's wait stretched to the heavy song's: 2 s
    waits.answered("heavy", last=False)
    assert waits.songs["heavy"][1] > time.monotonic() + 0.5  # the second window's wait: later_s scaled, 1 s
    waits.drop("heavy")
    waits.drop("plain")
    assert waits.overdue() == [] and not waits.songs


def test_a_songs_first_window_gets_the_first_chunk_wait_and_later_ones_the_shorter_wait():
    """The first window of a song waits first_chunk_s (its render may start cold), each later one later_s."""
    waits = ChunkDeadlines(first_chunk_s=0.4, later_s=0.1)
    before = time.monotonic()
    waits.sent("song")
    waits.sent("song")  # its second window out too
    after = time.monotonic()
    assert before + 0.4 <= waits.songs["song"][1] <= after + 0.4
    time.sleep(0.2)
    assert waits.overdue() == []  # past the later wait, within the first
    before = time.monotonic()
    waits.answered("song", last=False)  # window 0 came back; window 1 is still out
    after = time.monotonic()
    assert before + 0.1 <= waits.songs["song"][1] <= after + 0.1


def test_audio_of_one_song_restarts_the_waits_of_the_others():
    """A chunk of any song shows the worker working through its queue: the other songs' waits start again."""
    waits = ChunkDeadlines(first_chunk_s=1.0, later_s=1.0)  # margins of 0.5 s either way, for a loaded machine
    waits.sent("a")
    waits.sent("b")
    time.sleep(0.7)
    waits.answered("b", last=True)
    time.sleep(0.5)  # a's window went out 1.2 s ago, b's audio came 0.5 s ago
    assert waits.overdue() == []


def test_a_song_with_no_window_out_is_never_overdue():
    """Between windows (its audio so far all back, the next window not yet written) nothing of a song is due; its
    next window gets the later wait."""
    waits = ChunkDeadlines(first_chunk_s=0.1, later_s=0.2)
    waits.sent("a")
    waits.answered("a", last=False)
    assert waits.songs["a"][1] is None  # no deadline at all, not a later one
    time.sleep(0.15)
    assert waits.overdue() == []
    before = time.monotonic()
    waits.sent("a")
    assert before + 0.2 <= waits.songs["a"][1] <= time.monotonic() + 0.2


def test_at_most_twelve_windows_or_a_render_batch_and_four_more_wait_unread():
    """docs/api.md: at most max(12, render batch + 4) windows sit in /dev/shm unread by the worker."""
    assert [windows_in_flight(batch) for batch in (1, 8, 9, 20)] == [12, 12, 13, 24]


class Beating:
    """The engine's end of a worker that only sends heartbeats, each saying it has been busy `busy_s` (0: idle)."""

    def __init__(self, busy_s: float):
        self.busy_s = busy_s

    def get(self, channel: str, timeout_s: float) -> Message:
        time.sleep(min(timeout_s, 0.02))
        return Message("alive", {"busy_s": self.busy_s, "work": 1.0 if self.busy_s else 0.0}, {})


def payload(song: str, index: int) -> WindowPayload:
    return WindowPayload(song, 0, Window(index, 100 * index, 200, False), torch.zeros(200, 4))


def split_stage(connector=None, deadlines: ChunkDeadlines | None = None, outbox=None) -> tuple[WorkerStage1, list]:
    """The engine's side of the split placement over fakes (no worker process), and the songs it fails."""
    worker = RenderWorker.__new__(RenderWorker)
    worker.connector, worker.deadlines, worker.watch = connector, deadlines, WorkerWatch()
    worker.outbox = outbox or SimpleNamespace(failures=lambda: [])
    failed = []
    stage = WorkerStage1(worker, torch.device("cpu"), lambda chunk: None,
                         lambda song, message: failed.append((song, message)), threading.Event())
    return stage, failed


@pytest.mark.parametrize("busy_s, fails", [(0.0, True), (5.0, False)])
def test_only_the_heartbeats_of_a_worker_in_a_render_call_restart_the_waits(busy_s, fails):
    """A window sent and never answered fails its song while an idle worker's heartbeats keep coming; a worker in a
    render call restarts the waits (the song is queued behind that call)."""
    stage, failed = split_stage(Beating(busy_s), ChunkDeadlines(first_chunk_s=0.4, later_s=0.4))
    stage.worker.deadlines.sent("a")
    started = time.monotonic()
    while time.monotonic() - started < 1.0:
        assert stage.worker.receive(0.05) is None
        stage.check()
    assert failed == ([("a", "stage 1 sent no audio within the connector wait (0.4 s first, 0.4 s later)")]
                      if fails else [])


def test_a_window_the_connector_refused_fails_its_song_at_the_next_check_saying_why():
    """Not as a song that got no audio after the first-chunk wait: at once, with the connector's reason."""
    outbox = Outbox(Recorder(refuse={"a"}), WINDOWS)
    stage, failed = split_stage(deadlines=ChunkDeadlines(first_chunk_s=30, later_s=30), outbox=outbox)
    stage.send(payload("a", 0), ready=None)
    outbox.put(Message("stop", {}, {}))
    assert outbox.join(5)  # the writer tried the window
    stage.check()
    assert failed == [("a", "stage 1 could not take window 0: no space left in /dev/shm")]


def test_a_cancelled_song_is_not_failed_later_for_the_windows_it_had_out():
    """WorkerStage1.cancel drops the song's connector waits with the cancel: a window handed on before it is not
    waited for, so the song is not failed as silent once its wait is up, and nothing of it is kept."""
    sent: list[tuple[str, str]] = []
    outbox = SimpleNamespace(put=lambda message: sent.append((message.key, message.meta["song"])),
                             failures=lambda: [])
    waits = ChunkDeadlines(first_chunk_s=0.01, later_s=0.01)
    stage, failed = split_stage(deadlines=waits, outbox=outbox)
    stage.send(payload("a", 0), ready=None)
    stage.send(payload("b", 0), ready=None)  # not cancelled: its wait runs out as before
    due = max(deadline for _, deadline, _, _ in waits.songs.values())
    stage.cancel("a")
    assert sent == [("window", "a"), ("window", "b"), ("cancel", "a")]
    assert "a" not in waits.songs
    while time.monotonic() <= due:  # past both waits (10 ms), whatever the clock's resolution
        time.sleep(0.005)
    stage.check()
    assert [song for song, _ in failed] == ["b"] and waits.songs == {}


ORPHAN_PARENT = """
import os, sys
from music3serve.serving.engine import Engine
engine = Engine.from_pretrained(sys.argv[1], device="cpu", split=True)
print(engine.worker.process.pid, engine.worker.connector.prefix, flush=True)
sys.stdin.readline()  # killed here
"""


def test_a_worker_whose_server_was_killed_stops_and_removes_the_segments(tiny_dir):
    """SIGKILL of the engine's process (nothing of it runs its cleanup): the stage-1 worker notices its parent is
    gone, removes the connector's shared-memory segments and exits."""
    import subprocess
    import sys

    from music3serve.serving import shm_segments

    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_PARENT, str(tiny_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid, prefix = parent.stdout.readline().split()
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read().lower():
            assert time.monotonic() < deadline, "the orphaned worker is still running"
            time.sleep(0.1)
        assert not shm_segments.list_segments(prefix)
    finally:
        parent.kill()


class Pipes:
    """An in-process connector, a queue per channel; windows of the songs in `lost` arrive without their segment."""

    def __init__(self, lost: Iterable[str] = ()):
        self.channels = {WINDOWS: queue.Queue(), PCM: queue.Queue()}
        self.lost, self.cleaned = set(lost), False

    def put(self, channel: str, message: Message) -> None:
        self.channels[channel].put(message)

    def get(self, channel: str, timeout_s: float) -> Message:
        try:
            message = self.channels[channel].get(timeout=timeout_s) if timeout_s else self.channels[channel].get_nowait()
        except queue.Empty:
            raise ConnectorTimeout(channel) from None
        if message.meta.get("song") in self.lost:
            raise LostMessage("its segment is gone", message.meta)
        return message

    def said(self) -> list[Message]:
        """What the worker sent the engine, heartbeats left out."""
        out = []
        while not self.channels[PCM].empty():
            out.append(self.channels[PCM].get())
        return [message for message in out if message.key != "alive"]

    def cleanup(self) -> None:
        self.cleaned = True

    def close(self) -> None:
        pass


def run_worker_main(monkeypatch, connector: Pipes, slots, loop: Callable) -> None:
    """worker_main on this thread, its renderer faked and its render loop replaced by loop(inbox)."""

    class Loop:
        def __init__(self, renderer, inbox, on_chunk, on_error, rendering):
            self.inbox = inbox

        def run(self):
            loop(self.inbox)

    monkeypatch.setattr(worker_process.signal, "signal", lambda *args: None)  # pytest's own signal handlers stay
    monkeypatch.setattr(worker_process, "stage1_renderer", lambda models, stage1: None)
    monkeypatch.setattr(worker_process, "RenderLoop", Loop)
    worker_process.worker_main(lambda device: None, "cpu", None, connector, slots)


def test_a_lost_window_gives_its_slot_back_and_the_next_song_still_gets_through(monkeypatch):
    """The worker frees the slot of a window whose segment vanished: with a single slot, the next song's window is
    still written and read, and the lost window fails its song."""
    connector, slots = Pipes(lost={"a"}), threading.Semaphore(1)
    outbox = Outbox(connector, WINDOWS, slots)
    outbox.put(window_message(payload("a", 0)))
    outbox.put(window_message(payload("b", 0)))
    read = []

    def loop(inbox):
        deadline = time.monotonic() + 2.0
        while not read and time.monotonic() < deadline:
            read.extend(item[1].song for item in inbox(True) if item[0] == "window")

    try:
        run_worker_main(monkeypatch, connector, slots, loop)
    finally:
        outbox.close()
        assert outbox.join(5)
    assert read == ["b"]
    assert [m.meta for m in connector.said() if m.key == "failed"] == [
        {"song": "a", "message": "stage 1 lost a window on its way: its segment is gone"}
    ]


def test_an_orphaned_worker_removes_the_segments_and_stops(monkeypatch):
    """Its engine process gone (say SIGKILLed), the worker cleans the connector up, as nobody else is left to, and
    its render loop is told to stop."""
    connector, taken = Pipes(), []
    monkeypatch.setattr(worker_process.multiprocessing, "parent_process",
                        lambda: SimpleNamespace(is_alive=lambda: False))
    run_worker_main(monkeypatch, connector, threading.Semaphore(1), lambda inbox: taken.append(inbox(True)))
    assert taken == [[("stop",)]] and connector.cleaned


KILLED_CHILD_WITH_A_PROGRESS_BAR = """
import functools, multiprocessing as mp, os, signal, sys
from tqdm.auto import tqdm
from music3serve.serving.worker_process import worker_main

def load(writer, device):
    with tqdm(total=1, disable=True):  # as the checkpoint loader does; a disabled bar too takes tqdm's lock
        pass
    writer.send("loading")
    signal.pause()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    loader = functools.partial(load, writer)
    if sys.argv[1] == "worker":
        proc = ctx.Process(target=worker_main, args=(loader, "cpu", None, None, None))
    else:
        proc = ctx.Process(target=loader, args=("cpu",))
    proc.start()
    assert reader.recv() == "loading"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
"""


@pytest.mark.parametrize("lock", ["worker", "tqdm's default"])
def test_a_worker_killed_after_a_progress_bar_leaves_no_semaphore_to_report(lock, tmp_path):
    """tqdm's default lock is a multiprocessing semaphore: a stage-1 worker killed with SIGKILL while loading (or
    after) left it registered, and the resource tracker warned of a leaked semaphore when the engine process exited.
    worker_main gives tqdm a thread lock first; the same loader outside worker_main shows that the scenario does
    reproduce the warning."""
    script = tmp_path / "killed_child.py"
    script.write_text(textwrap.dedent(KILLED_CHILD_WITH_A_PROGRESS_BAR))
    src = str(Path(worker_process.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script), lock.split()[0]], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert ("leaked semaphore" in done.stderr) == (lock != "worker"), done.stderr
