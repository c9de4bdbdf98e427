"""The engine API on the CPU with the tiny checkpoint: the example deploy YAML streams the offline pipeline's song,
events come in order, concurrent songs equal their solo runs, cancel frees rows, bad input is refused before
anything is queued, audio_end ends a song early, and the Prometheus exposition counts what happened.

Every await is bounded (asyncio.wait_for) so a stuck engine fails a test instead of hanging the run; engines are
closed in fixture finalizers. `Engine.submit` is an async generator: calling it runs nothing, validation and
queueing happen on the first `__anext__`, which is where InputError surfaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest
import torch

from music3serve import contract
from music3serve.acoustic.windows import song_samples, song_windows
from music3serve.checkpoint import load_models
from music3serve.errors import EngineBusy, InputError, Music3Error
from music3serve.pipeline import Pipeline
from music3serve.prompt import encode_prompt
from music3serve.serving.deploy_config import load_deploy_config, parse_deploy_config, with_quantization
from music3serve.serving.engine import Engine
from music3serve.serving.engine_limits import PCM_BYTES_PER_SAMPLE
from music3serve.serving.events import Accepted, AudioChunk, Done, Event, Failed, SongRequest
from music3serve.serving.heartbeat import StageWatch
from music3serve.serving.held_songs import callers_ids
from music3serve.serving.stage1 import LocalStage1
from failing_prefill import FailingPrefill  # tests/ is on the import path (no package)
from polling import poll_until
from song_keys import caller_id


def callers(keys) -> set[str]:
    """The callers' ids of the song keys a stage holds."""
    return {caller_id(key) for key in keys}


EXAMPLE_YAML = Path(__file__).parents[1] / "examples" / "deploy" / "minimax_music3.yaml"
EVENT_TIMEOUT = 120.0  # seconds for any single event; the tiny model needs well under 5 on a busy CI core
TEST_TIMEOUT = 600.0
STEPS = 2
# Two runs of one song that differ by float32 rounding only (the talker's decode attention vs SDPA, a batch's matmuls
# vs a single row's), amplified by the tiny random DiT and vocoder: measured at worst 7.4e-5 max abs and 3.1e-5
# relative L2 below (peaks ~0.7). The bounds are twice / three times that; PCM rounded through float16 on its way
# (2.4e-4 max abs) or any lossier copy fails them, as the former 1e-3 did not.
PCM_MAX_ABS, PCM_REL = 1.5e-4, 1e-4

# Eight songs of different prompts, lengths (2..9 s: 50..225 frames, one or two windows) and seeds.
CAPTIONS = [
    "dreamy synth-pop",
    "acoustic folk ballad with a long description of guitars and harmonica",
    "drum and bass",
    "jazz trio",
    "metal",
    "ambient drone",
    "k-pop",
    "lofi hip hop beats to study to",
]
SONGS = [
    SongRequest(caption, f"[verse]\nline {i}\n[chorus]\nhey " * (1 + i % 3), 2.0 + i, seed=i, steps=STEPS)
    for i, caption in enumerate(CAPTIONS)
]


# Helpers.
def run(coro, timeout: float = TEST_TIMEOUT):
    """Run a coroutine on a fresh event loop, bounded."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def request(index: int, **changes) -> SongRequest:
    base = SONGS[index]
    fields = dict(caption=base.caption, lyrics=base.lyrics, duration_s=base.duration_s, seed=base.seed, steps=base.steps)
    return SongRequest(**(fields | changes))


async def next_event(stream):
    return await asyncio.wait_for(stream.__anext__(), EVENT_TIMEOUT)


async def close_stream(stream) -> None:
    await asyncio.wait_for(stream.aclose(), EVENT_TIMEOUT)


async def collect(engine: Engine, req: SongRequest, log: list | None = None) -> list:
    """Every event of one song until its stream ends; `log` (shared by concurrent songs) records arrival order."""
    stream = engine.submit(req)
    events = []
    try:
        while True:
            try:
                event = await next_event(stream)
            except StopAsyncIteration:
                return events
            events.append(event)
            if log is not None:
                log.append(event)
    finally:
        await close_stream(stream)


async def wait_until(predicate: Callable[[], bool], what: str, timeout: float = EVENT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.01)


def pcm(events: list) -> np.ndarray:
    return np.concatenate([e.pcm for e in events if isinstance(e, AudioChunk)], axis=-1)


def differences(ours: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """Max absolute and relative L2 difference of two waveforms of one shape."""
    assert ours.shape == reference.shape
    diff = ours.astype(np.float64) - reference.astype(np.float64)
    return float(np.abs(diff).max()), float(np.linalg.norm(diff) / np.linalg.norm(reference))


def check_stream(events: list, req: SongRequest, prompt_tokens: int) -> None:
    """Accepted, then AudioChunk windows 0..n-1 (last only on the final one), then Done; nothing else."""
    assert events, "the stream ended without an event"
    accepted, *chunks, done = events
    assert isinstance(accepted, Accepted), events[0]
    assert isinstance(done, Done), f"stream ended with {done!r}"
    assert all(isinstance(c, AudioChunk) for c in chunks) and chunks, [type(e).__name__ for e in events]
    song = accepted.song
    assert all(e.song == song for e in events)
    if req.id is not None:
        assert song == req.id
    if req.seed is not None:
        assert accepted.seed == req.seed
    assert 0 <= accepted.seed < 2**64
    assert accepted.prompt_tokens == prompt_tokens
    assert accepted.budget_frames == min(int(req.duration_s * contract.FRAME_RATE), contract.MAX_FRAMES,
                                         contract.MAX_CONTEXT - prompt_tokens)
    assert [c.window for c in chunks] == list(range(len(chunks)))
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    for c in chunks:
        assert c.pcm.dtype == np.float32 and c.pcm.ndim == 2 and c.pcm.shape[0] == 2
        assert np.isfinite(c.pcm).all() and np.abs(c.pcm).max() <= 1.0
    assert 1 <= done.frames <= accepted.budget_frames
    assert done.ended_by in ("budget", "audio_end")
    assert (done.ended_by == "budget") == (done.frames == accepted.budget_frames)
    assert len(chunks) == len(song_windows(done.frames))
    assert pcm(events).shape == (2, song_samples(done.frames))
    assert 0 < done.timings["first_audio_s"] <= done.timings["total_s"]


def samples(engine: Engine) -> dict[str, float]:
    """The engine's Prometheus exposition as {sample name with labels: value}."""
    text = engine.metrics.exposition().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def prompt_tokens(engine: Engine, req: SongRequest) -> int:
    return len(encode_prompt(engine.tokenizer, req.caption, req.lyrics)[0])


# Fixtures.
@pytest.fixture(scope="module")
def models(tiny_dir: Path):
    """CPU override of the example deploy file: every component on the CPU, the talker in float32."""
    return load_models(tiny_dir, "cpu")


@pytest.fixture(scope="module")
def deploy():
    return load_deploy_config(EXAMPLE_YAML)


def make_engine(models, deploy):
    engine = Engine(models, deploy)
    assert engine.device.type == "cpu"
    return engine


def shut(engine: Engine) -> None:
    engine.close()
    assert not any(t.is_alive() for t in engine._threads), "engine threads still running after close()"


@pytest.fixture(scope="module")
def engine(models, deploy):
    engine = make_engine(models, deploy)
    yield engine
    shut(engine)


@pytest.fixture(scope="module")
def solo(engine):
    """solo(i): SONGS[i]'s events submitted alone through the shared engine (cached)."""
    cache: dict[int, list] = {}

    def get(index: int) -> list:
        if index not in cache:
            cache[index] = run(collect(engine, request(index)))
        return cache[index]

    return get


@pytest.fixture(scope="module")
def seed_song(engine, models):
    """One song through the engine and through the offline pipeline, same models and seed."""
    req = SongRequest("dreamy synth-pop", "[verse]\nneon skies\n[chorus]\nhey", 10.0, seed=3, steps=STEPS, id="seed")
    events = run(collect(engine, req))
    song = Pipeline(models).generate(req.caption, req.lyrics, req.duration_s, req.seed, req.steps)
    return req, events, song


# Tests.
def test_example_yaml_engine_equals_offline_pipeline(engine, seed_song):
    assert engine.deploy.source == str(EXAMPLE_YAML)
    req, events, song = seed_song
    accepted, done = events[0], events[-1]
    assert isinstance(done, Done), events[-1]
    assert accepted.budget_frames == song.budget
    assert (done.frames, done.ended_by) == (song.frames, song.ended_by) == (250, "budget")
    streamed = pcm(events)
    assert streamed.shape == song.waveform.shape
    # The talker engine attends with the decode-attention reference, the offline pipeline with SDPA; the codes
    # agree and the conditioning differs by rounding, which the tiny random DiT/vocoder amplify. Measured here
    # (10 s, seed 3, 2 steps, 2 windows): max abs 5.8e-5, relative L2 3.0e-5 (peak amplitude 0.67).
    max_abs, rel = differences(streamed, song.waveform)
    assert max_abs < PCM_MAX_ABS and rel < PCM_REL, (max_abs, rel)


def test_stage1_weights_past_their_memory_share_fail_at_startup(models, deploy, monkeypatch):
    """Stage 1's gpu_memory_utilization was only summed with stage 0's: its weights must now fit in it (on the CPU,
    in the machine's memory), or the engine refuses to start with the numbers."""
    monkeypatch.setattr("music3serve.serving.render_loop.host_memory", lambda: 1 << 10)
    policy = deploy.stages[1].dtype
    advice = ": run stage 1 in bfloat16" if policy == "float32" else ""
    with pytest.raises(Music3Error, match=rf"stage 1 needs 0\.0 GiB of {policy} weights, more than this machine's "
                                          rf"0\.0 GiB of memory{advice}$"):
        Engine(models, deploy)


def test_events_come_in_order(engine, seed_song):
    req, events, _ = seed_song
    check_stream(events, req, prompt_tokens(engine, req))
    assert len(events) == 4  # Accepted, two windows (250 frames: 0..200 and 100..250), Done


def test_a_request_without_a_seed_gets_one(engine):
    req = request(0, seed=None)
    events = run(collect(engine, req))
    check_stream(events, req, prompt_tokens(engine, req))


def test_eight_concurrent_songs_equal_their_solo_runs(engine, solo):
    expected = [solo(i) for i in range(len(SONGS))]
    for i, events in enumerate(expected):
        check_stream(events, SONGS[i], prompt_tokens(engine, SONGS[i]))
        assert events[-1].frames == int(SONGS[i].duration_s * contract.FRAME_RATE)

    async def together():
        log: list = []
        results = await asyncio.gather(*[collect(engine, request(i), log) for i in range(len(SONGS))])
        return results, log

    results, log = run(together())
    first_done = next(k for k, e in enumerate(log) if isinstance(e, Done))
    assert sum(isinstance(e, Accepted) for e in log[:first_done]) == len(SONGS), "the songs did not overlap"
    worst = (0.0, 0.0)
    for i, (events, alone) in enumerate(zip(results, expected)):
        check_stream(events, SONGS[i], prompt_tokens(engine, SONGS[i]))
        assert (events[-1].frames, events[-1].ended_by) == (alone[-1].frames, alone[-1].ended_by)
        assert [c.window for c in events[1:-1]] == [c.window for c in alone[1:-1]]
        # Not bit-exact on the CPU: the talker's conditioning and the renderer's batched DiT matmuls round
        # differently with the batch (tests/test_talker_engine.py, tests/test_renderer.py), and the tiny random
        # vocoder amplifies that. Measured over the eight songs: max abs 7.4e-5, relative L2 3.1e-5 at worst.
        # (A solo run repeated is bit-identical: see test_duplicate_id_is_refused_while_the_first_runs.)
        worst = tuple(map(max, worst, differences(pcm(events), pcm(alone))))
    assert worst[0] < PCM_MAX_ABS and worst[1] < PCM_REL, worst
    assert not engine.talker.busy and not engine.talker.songs and engine.renderer.songs == []


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_cancel_frees_rows_and_leaves_other_songs_alone(engine, solo, how):
    bystanders = [5, 7]  # 7 s and 9 s
    expected = {i: solo(i) for i in bystanders}
    victim = SongRequest("victim", "[verse]\ncut short", 30.0, seed=99, steps=STEPS, id=f"victim-{how}")

    async def scenario():
        stream = engine.submit(victim)
        try:
            assert isinstance(await next_event(stream), Accepted)
            first = await next_event(stream)
            assert isinstance(first, AudioChunk) and first.window == 0 and not first.last
            # The victim is mid-song (window 0 needs 201 of its 750 frames) and the renderer holds its carry.
            assert victim.id in callers(engine.talker.songs)
            # The bystanders join and start decoding in the pairs after the victim's, so freeing the victim's pair
            # moves the last active pair into the gap while both bystanders are mid-song.
            tasks = [asyncio.ensure_future(collect(engine, request(i, id=f"{how}-{i}"))) for i in bystanders]
            await wait_until(lambda: {f"{how}-{i}" for i in bystanders} <= callers(s.id for s in list(engine.talker.active)),
                             "the bystanders decode")
            assert victim.id in callers(engine.talker.songs)
            if how == "aclose":
                await close_stream(stream)
            else:
                engine.cancel(victim.id)
            await wait_until(lambda: victim.id not in callers(engine.talker.songs), "the talker drops the victim")
            await wait_until(lambda: victim.id not in callers(engine.renderer.songs), "the renderer drops the victim")
            assert victim.id not in callers(s.id for s in list(engine.talker.active))
            results = await asyncio.gather(*tasks)
        finally:
            await close_stream(stream)
        return results

    results = run(scenario())
    for i, events in zip(bystanders, results):
        check_stream(events, request(i, id=f"{how}-{i}"), prompt_tokens(engine, SONGS[i]))
        assert (events[-1].frames, events[-1].ended_by) == (expected[i][-1].frames, expected[i][-1].ended_by)
        # Same batch rounding as the concurrent test; measured max abs 7.4e-5, relative L2 3.1e-5.
        max_abs, rel = differences(pcm(events), pcm(expected[i]))
        assert max_abs < PCM_MAX_ABS and rel < PCM_REL, (i, max_abs, rel)
    assert not engine.talker.busy and not engine.talker.songs and not engine.talker.active
    assert engine.renderer.songs == []


def test_cancel_by_id_ends_the_stream(engine):
    req = SongRequest("cancelled", "[verse]\nstop", 30.0, seed=5, steps=STEPS, id="cancel-ends-stream")

    async def scenario():
        stream = engine.submit(req)
        try:
            assert isinstance(await next_event(stream), Accepted)
            engine.cancel(req.id)
            rest = []
            try:
                while True:
                    rest.append(await asyncio.wait_for(stream.__anext__(), 5))
            except StopAsyncIteration:
                pass
            except asyncio.TimeoutError:
                raise AssertionError("the stream is still open 5 s after cancel(id)") from None
        finally:
            await close_stream(stream)
        assert not any(isinstance(e, Done) for e in rest)
        await wait_until(lambda: req.id not in callers(engine.talker.songs), "the talker drops the song")

    run(scenario())


BAD = {
    "empty caption": dict(caption=""),
    "blank caption": dict(caption="   \n"),
    "duration 0": dict(duration_s=0),
    "duration nan": dict(duration_s=float("nan")),
    "seed -1": dict(seed=-1),
    "seed True": dict(seed=True),
    "steps 0": dict(steps=0),
    "id not a string": dict(id=5),
}


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
def test_bad_input_raises_before_anything_is_queued(engine, bad):
    before = samples(engine)["music3_requests_total"]

    async def scenario():
        stream = engine.submit(request(0, **BAD[bad]))
        try:
            with pytest.raises(InputError):
                await next_event(stream)
        finally:
            await close_stream(stream)

    run(scenario())
    assert samples(engine)["music3_requests_total"] == before
    assert not engine.talker.songs and not engine.talker.busy


def test_a_song_cancelled_between_its_hold_and_its_submit_is_never_decoded(engine, monkeypatch):
    """A cancel from another thread just after the engine holds a song, before it submits it to the talker loop,
    reaches the loop first (and finds nothing to cancel); the song, taken next, was decoded anyway, for nobody."""
    hold, submit, taken = engine.held.hold, engine.talker.submit, []

    def hold_then_cancel(key, client):
        hold(key, client)
        if client.song == "raced":
            assert engine.cancel("raced")  # as another thread's DELETE would, here at once: no timing involved

    def recording(song, *args):
        taken.append(caller_id(song))
        return submit(song, *args)

    monkeypatch.setattr(engine.held, "hold", hold_then_cancel)
    monkeypatch.setattr(engine.talker, "submit", recording)
    before = samples(engine)

    async def scenario():
        raced = await collect(engine, request(0, id="raced"))
        # Queued behind "raced" (one queue, in order): once this song is done, the loop has taken "raced" too.
        return raced, await collect(engine, request(1, id="after", duration_s=1.0))

    raced, after = run(scenario())
    assert [(type(e), e.message) for e in raced] == [(Failed, "cancelled")] and isinstance(after[-1], Done)
    assert taken == ["after"]
    now = samples(engine)
    assert now["music3_requests_total"] == before["music3_requests_total"] + 1
    assert now["music3_cancels_total"] == before["music3_cancels_total"] + 1


def test_two_callers_racing_for_one_id_get_one_song(engine, monkeypatch):
    """Two submits of one id from two threads, each on its own event loop, both past their other checks at once: one
    song runs, the other submit is refused (the id's check and claim were apart, and both songs ran under it)."""
    barrier, key = threading.Barrier(2, timeout=EVENT_TIMEOUT), engine.held.new_key

    def key_when_both_are_here(song: str) -> str:
        barrier.wait()
        return key(song)

    monkeypatch.setattr(engine.held, "new_key", key_when_both_are_here)
    results: list = []

    def caller(seed: int) -> None:
        try:
            results.append(run(collect(engine, request(0, id="contested", seed=seed, duration_s=1.0))))
        except InputError as exc:
            results.append(exc)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TEST_TIMEOUT)
    refused = [r for r in results if isinstance(r, InputError)]
    songs = [r for r in results if isinstance(r, list)]
    assert len(refused) == len(songs) == 1 and "'contested' is taken" in str(refused[0])
    assert isinstance(songs[0][-1], Done)


def test_duplicate_id_is_refused_while_the_first_runs(engine, solo):
    expected = solo(3)

    async def scenario():
        first = engine.submit(request(3, id="twice"))
        try:
            assert isinstance(await next_event(first), Accepted)
            requests = samples(engine)["music3_requests_total"]
            second = engine.submit(request(0, id="twice"))
            with pytest.raises(InputError, match="'twice' is taken by a song whose stream has not ended"):
                await next_event(second)
            await close_stream(second)
            assert samples(engine)["music3_requests_total"] == requests
            rest = []
            async for event in _bounded(first):
                rest.append(event)
        finally:
            await close_stream(first)
        return rest

    rest = run(scenario())
    assert isinstance(rest[-1], Done)
    assert rest[-1].frames == expected[-1].frames
    assert differences(pcm(rest), pcm(expected))[0] < PCM_MAX_ABS
    # The id is free again once its stream ended; a song run alone again is bit-identical to its first solo run.
    events = run(collect(engine, request(0, id="twice")))
    check_stream(events, request(0, id="twice"), prompt_tokens(engine, SONGS[0]))
    assert np.array_equal(pcm(events), pcm(solo(0)))


async def _bounded(stream):
    while True:
        try:
            yield await next_event(stream)
        except StopAsyncIteration:
            return


@pytest.fixture(scope="module")
def ending_models(ending_dir: Path):
    return load_models(ending_dir, "cpu")


@pytest.fixture
def ending_engine(ending_models, deploy):
    engine = make_engine(ending_models, deploy)
    yield engine
    shut(engine)


def test_audio_end_ends_a_song_early(ending_engine, ending_models):
    # With the boost, "dreamy synth-pop" seed 3 draws audio_end after 26 frames of its 250-frame budget (offline),
    # and seed 2 draws it at once, which fails the song.
    req = SongRequest("dreamy synth-pop", "[verse]\nneon skies", 10.0, seed=3, steps=STEPS)
    at_once = SongRequest("dreamy synth-pop", "[verse]\nneon skies", 10.0, seed=2, steps=STEPS)

    async def both():
        return await asyncio.gather(collect(ending_engine, req), collect(ending_engine, at_once))

    events, failed = run(both())
    check_stream(events, req, prompt_tokens(ending_engine, req))
    done = events[-1]
    assert done.ended_by == "audio_end" and done.frames < events[0].budget_frames == 250
    song = Pipeline(ending_models).generate(req.caption, req.lyrics, req.duration_s, req.seed, req.steps)
    assert (done.frames, done.ended_by) == (song.frames, song.ended_by)
    max_abs, rel = differences(pcm(events), song.waveform)  # measured: max abs 4.1e-5, relative L2 3.0e-5
    assert max_abs < PCM_MAX_ABS and rel < PCM_REL, (max_abs, rel)

    assert [type(e) for e in failed] == [Accepted, Failed]
    assert "first frame" in failed[-1].message
    metrics = samples(ending_engine)
    assert metrics["music3_requests_total"] == 2 and metrics["music3_failures_total"] == 1
    assert metrics["music3_frames_total"] == done.frames
    assert not ending_engine.talker.songs and ending_engine.renderer.songs == []


@pytest.fixture
def fresh_engine(models, deploy):
    engine = make_engine(models, deploy)
    yield engine
    shut(engine)


def test_metrics_count_requests_windows_and_frames(fresh_engine):
    engine = fresh_engine
    zero = samples(engine)
    assert zero["music3_requests_total"] == zero["music3_windows_total"] == zero["music3_frames_total"] == 0

    async def scenario():
        stream = engine.submit(request(0, steps=0))  # refused: not counted
        with pytest.raises(InputError):
            await next_event(stream)
        return await asyncio.gather(collect(engine, request(0)), collect(engine, request(7)))

    short, long = run(scenario())
    assert [len(song_windows(e[-1].frames)) for e in (short, long)] == [1, 2]  # 50 and 225 frames
    metrics = samples(engine)
    text = engine.metrics.exposition().decode()
    assert "# TYPE music3_requests_total counter" in text and "# TYPE music3_windows_total counter" in text
    assert "_created" not in text  # prometheus_client's creation timestamps: a second series per metric, unused
    assert metrics["music3_requests_total"] == 2
    assert metrics["music3_windows_total"] == 3
    assert metrics["music3_failures_total"] == 0
    assert metrics["music3_frames_total"] == 50 + 225
    # One step per frame of the longest song plus its first (not emitted) frame, at most one per frame of each.
    assert 226 <= metrics["music3_talker_steps_total"] <= 51 + 226
    assert metrics["music3_first_audio_seconds_count"] == metrics["music3_song_seconds_count"] == 2
    assert 0 < metrics["music3_first_audio_seconds_sum"] <= metrics["music3_song_seconds_sum"]
    assert metrics['music3_song_seconds_bucket{le="+Inf"}'] == 2
    totals = sorted(e[-1].timings["total_s"] for e in (short, long))
    assert metrics["music3_song_seconds_sum"] == pytest.approx(sum(totals))


class HeldRenders:
    """Patches the engine's renderer: a render call holding a window of the song with `seed` waits inside the
    renderer until `release` is set (or raises `error`), so a test can act while stage 1 is busy with it."""

    def __init__(self, engine: Engine, seed: int, error: Exception | None = None):
        self.engine, self.seed, self.error = engine, seed, error
        self.rendering, self.release = threading.Event(), threading.Event()
        self.real = engine.renderer.render

    def __call__(self, batch):
        if any(p.seed == self.seed for p in batch):
            self.rendering.set()
            self.release.wait(EVENT_TIMEOUT)
            if self.error is not None:
                raise self.error
        return self.real(batch)

    def __enter__(self) -> "HeldRenders":
        self.engine.renderer.render = self
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.engine.renderer.render = self.real


def queued_window(engine: Engine, song: str, index: int) -> bool:
    """Whether window `index` of song `song` (the caller's id) waits in the queue to stage 1."""
    return any(item[0] == "window" and caller_id(item[1].song) == song and item[1].window.index == index
               for item in list(engine.stage1.windows.queue))


def test_a_song_submitted_again_under_a_cancelled_ones_id_gets_only_its_own_audio(engine, solo):
    """Song "reused" is cancelled while stage 1 renders its window, and a new song is submitted at once under the
    same id: the old render's audio must not reach it (each submission has a key of its own in the stages)."""
    expected, again = solo(0), request(0, id="reused")

    async def scenario(held: HeldRenders):
        first = engine.submit(request(3, id="reused", seed=1234))
        assert isinstance(await next_event(first), Accepted)
        await wait_until(held.rendering.is_set, "stage 1 renders the first song's window")
        engine.cancel("reused")
        assert (await next_event(first)).message == "cancelled"
        await close_stream(first)
        second = asyncio.ensure_future(collect(engine, again))
        await wait_until(lambda: engine.held.key_of("reused") is not None, "the second song is held")
        held.release.set()  # the first song's render finishes now, after the second song took its id
        return await second

    with HeldRenders(engine, seed=1234) as held:
        events = run(scenario(held))
    check_stream(events, again, prompt_tokens(engine, again))
    assert np.array_equal(pcm(events), pcm(expected))


def test_a_cancelled_songs_id_is_free_at_once_not_when_its_stream_is_read_to_the_end(engine, solo):
    """A DELETE then a POST under the same id: the new submit used to be refused ("taken by a song still running")
    until the caller had read or closed the cancelled song's stream."""
    expected, again = solo(0), request(0, id="reused")

    async def scenario():
        first = engine.submit(request(3, id="reused", seed=99))
        assert isinstance(await next_event(first), Accepted)
        assert engine.cancel("reused")
        second = engine.submit(again)
        events = [await next_event(second)]  # accepted before the first stream is read or closed
        assert (await next_event(first)).message == "cancelled"
        await close_stream(first)
        try:
            async for event in second:
                events.append(event)
        finally:
            await close_stream(second)
        return events

    events = run(scenario())
    check_stream(events, again, prompt_tokens(engine, again))
    assert np.array_equal(pcm(events), pcm(expected))


def test_a_cancel_after_the_talker_refused_the_song_changes_and_counts_nothing(engine, monkeypatch):
    """A song the talker refused (HTTP 400) has ended, its Failed on its way: a cancel then returned True and counted
    a cancel for a song that was never accepted (music3_cancels moved, music3_requests did not)."""

    def refuse(*args):
        raise InputError("injected refusal")

    monkeypatch.setattr(engine.talker, "submit", refuse)
    before = engine.metrics.registry.get_sample_value("music3_cancels_total")

    async def scenario():
        stream = engine.submit(request(0, id="refused-then-cancelled"))
        try:
            event = await next_event(stream)
            assert isinstance(event, Failed) and event.refused, event
            return engine.cancel("refused-then-cancelled")
        finally:
            await close_stream(stream)

    assert run(scenario()) is False
    assert engine.metrics.registry.get_sample_value("music3_cancels_total") == before


def test_a_failed_render_fails_only_its_song_also_with_its_next_window_queued(engine, solo):
    """The render of a two-window song fails while its second window and another song's window wait for stage 1:
    the failed song's window is dropped, not batched with the other song's (where it would fail both)."""
    expected, bystander = solo(0), request(0, id="bystander")

    def failures() -> float:
        return engine.metrics.registry.get_sample_value("music3_failures_total")

    async def scenario(held: HeldRenders):
        doomed = asyncio.ensure_future(collect(engine, request(7, id="doomed", seed=4321)))
        await wait_until(held.rendering.is_set, "stage 1 renders the doomed song's first window")
        other = asyncio.ensure_future(collect(engine, bystander))
        await wait_until(lambda: queued_window(engine, "doomed", 1) and queued_window(engine, "bystander", 0),
                         "both windows wait for stage 1")
        before = failures()
        held.release.set()
        return await doomed, await other, before

    real_cancel = engine.talker.cancel

    def slow_cancel(song: str) -> None:  # the talker busy with a step: stage 1 sees the next windows first
        if caller_id(song) == "doomed":
            time.sleep(1.0)
        real_cancel(song)

    engine.talker.cancel = slow_cancel
    try:
        with HeldRenders(engine, seed=4321, error=RuntimeError("injected render failure")) as held:
            doomed, events, before = run(scenario(held))
    finally:
        del engine.talker.cancel
    assert isinstance(doomed[-1], Failed) and "injected render failure" in doomed[-1].message
    assert "doomed#" not in doomed[-1].message
    check_stream(events, bystander, prompt_tokens(engine, bystander))
    # It ran in the talker beside the doomed song: not bit-exact on the CPU (see the eight-song test).
    max_abs, rel = differences(pcm(events), pcm(expected))
    assert max_abs < PCM_MAX_ABS and rel < PCM_REL, (max_abs, rel)
    assert failures() == before + 1  # one failed song, counted once


class FailingStep:
    """The talker's frame step, except that it raises once, at the first call made while `when()` holds."""

    def __init__(self, step, when: Callable[[], bool]):
        self.step, self.when, self.failed = step, when, False

    def __getattr__(self, name: str):
        return getattr(self.step, name)

    def __call__(self, rows: int) -> None:
        if not self.failed and self.when():
            self.failed = True
            raise RuntimeError("injected step failure")
        self.step(rows)


def test_a_failed_frame_step_fails_the_songs_in_it_not_those_queued(models):
    """One pair of rows: song "running" decodes while song "queued" waits for its rows. A frame step raises: the
    song in it fails with the reason, the queued song (accepted, not yet started) takes the rows and finishes."""
    deploy = parse_deploy_config({"stages": [{"stage_id": 0, "max_num_seqs": 2}, {"stage_id": 1, "max_num_seqs": 1}]},
                                 "one-pair test deploy")
    engine = Engine(models, deploy)
    queued_in_talker = lambda: "queued" in callers(s.id for s in engine.talker.waiting)  # noqa: E731
    engine.talker.step_fn = FailingStep(engine.talker.step_fn, queued_in_talker)

    async def scenario():
        running = asyncio.ensure_future(collect(engine, SongRequest("pop", "[verse]\nfirst", 8.0, 1, 1, id="running")))
        await wait_until(lambda: "running" in callers(s.id for s in list(engine.talker.active)),
                         "the first song decodes")
        queued = await collect(engine, SongRequest("pop", "[verse]\nsecond", 1.0, 2, 1, id="queued"))
        return await running, queued

    try:
        running, queued = run(scenario())
    finally:
        shut(engine)
    assert engine.talker.step_fn.failed
    assert isinstance(running[-1], Failed) and "injected step failure" in running[-1].message
    assert isinstance(queued[0], Accepted) and isinstance(queued[-1], Done), queued
    assert queued[-1].frames == 25


def test_a_failed_frame_step_also_drops_the_windows_its_songs_had_sent_to_stage_1(models, deploy):
    """The step fails after stage 1 rendered the song's window 0: stage 1 forgets the song at once (it kept the song's
    carry, and the talker loop its held windows and Euler steps, until the caller read its stream to the end)."""
    engine = make_engine(models, deploy)
    rendered = lambda: bool(engine.renderer.songs)  # noqa: E731  (window 0 rendered: stage 1 holds the song's carry)
    engine.talker.step_fn = FailingStep(engine.talker.step_fn, rendered)

    async def scenario():
        stream = engine.submit(SongRequest("pop", "[verse]\nla", 12.0, 1, 1, id="failing"))
        try:
            assert isinstance(await next_event(stream), Accepted)
            await wait_until(lambda: engine.talker.step_fn.failed, "the step fails")
            # Before its caller reads on (which frees the song everywhere, however it ended).
            await wait_until(lambda: not engine.renderer.songs, "stage 1 forgets the failed song", timeout=30)
            events = [event async for event in stream]
        finally:
            await close_stream(stream)
        assert isinstance(events[-1], Failed) and "injected step failure" in events[-1].message

    try:
        run(scenario())
    finally:
        shut(engine)


def test_a_step_that_fails_with_no_song_decoding_fails_the_queue_instead_of_repeating(models, deploy):
    """A step that raises before any song decodes (say the device is gone) fails the songs waiting for it; failing
    only the decoding songs (none) would meet the same failure at every step while the queue waits forever."""
    engine = make_engine(models, deploy)

    def gone():
        raise RuntimeError("injected device loss")

    engine.talker._on_stream = gone
    try:
        events = run(collect(engine, SongRequest("pop", "[verse]\nla", 1.0, 1, 1, id="stuck")))
    finally:
        shut(engine)
    assert isinstance(events[-1], Failed) and "injected device loss" in events[-1].message


def test_a_talker_whose_steps_keep_failing_stops_and_the_engine_says_why(models, deploy):
    """Each failed step fails its songs and the engine goes on; three in a row (three songs, one after another) are
    the device's fault: stage 0 stops, the engine is unavailable with the reason and refuses the next song, where it
    would fail every song it takes while looking healthy."""
    engine = make_engine(models, deploy)

    def gone():
        raise RuntimeError("injected sticky device error")

    engine.talker._on_stream = gone
    try:
        for i in range(3):
            assert engine.unavailable() is None
            events = run(collect(engine, SongRequest("pop", "[verse]\nla", 1.0, i, 1, id=f"song{i}")))
            assert isinstance(events[-1], Failed) and "injected sticky device error" in events[-1].message
        run(wait_until(lambda: engine.unavailable() is not None, "stage 0 stops"))
        # The messages alone, no exception reprs: "engine stage stopped (music3-talker): stage 0 failed 3 steps in a
        # row (the last: injected sticky device error); it stops".
        assert "stage 0 failed 3 steps in a row (the last: injected sticky device error)" in engine.unavailable()
        assert "Error(" not in engine.unavailable()
        with pytest.raises(Music3Error, match="stage 0 failed 3 steps in a row"):
            run(collect(engine, SongRequest("pop", "[verse]\nla", 1.0, 3, 1, id="after")))
    finally:
        shut(engine)


def test_failed_steps_count_toward_stopping_only_while_no_step_succeeds_between_them(models, deploy):
    """Two failed steps, a song that finishes, then one more failed step: three failures over the engine's life, but
    never three in a row, so stage 0 goes on serving (a success resets the count)."""
    engine = make_engine(models, deploy)
    failing = threading.Event()

    def sometimes_gone():
        if failing.is_set():
            raise RuntimeError("injected passing device error")
        return contextlib.nullcontext()

    engine.talker._on_stream = sometimes_gone

    def song(i: int) -> list:
        return run(collect(engine, SongRequest("pop", "[verse]\nla", 1.0, i, 1, id=f"song{i}")))

    try:
        for i, fails in enumerate([True, True, False, True]):
            if fails:
                failing.set()
            else:
                failing.clear()
            events = song(i)
            if fails:
                assert isinstance(events[-1], Failed) and "injected passing device error" in events[-1].message
            else:
                assert isinstance(events[-1], Done), events[-1]
        failing.clear()
        assert isinstance(song(4)[-1], Done)
        assert engine.unavailable() is None
    finally:
        shut(engine)


@pytest.mark.parametrize("stage, where", [
    ("stage 0", "step"), ("stage 0", "hand-over"), ("stage 0", "admission"), ("stage 1", "render"),
])
def test_a_stage_call_that_never_ends_fails_its_songs_and_the_engine_says_why(models, deploy, stage, where):
    """A talker step (or its windows' hand-over to stage 1: on a GPU, split, their copy to the host; or taking a song,
    which copies its prompt to the device behind the step in flight) or a render call
    that never returns (say a GPU wait that hangs, the GIL free): past its limit the watch fails the songs, where
    their streams waited forever, and the engine reports itself unavailable (HTTP /health 503) and refuses the next
    song; close() does not wait for the stuck thread. On the CPU there is no limit (heartbeat.hang_limit): the test
    sets one."""
    engine = make_engine(models, deploy)
    release = threading.Event()
    target, name = {"step": (engine.talker, "step"), "hand-over": (engine.stage1, "send"),
                    "admission": (engine.talker, "submit"), "render": (engine.renderer, "render")}[where]
    real = getattr(target, name)

    def stuck(*args, **kwargs):
        release.wait(TEST_TIMEOUT)
        return real(*args, **kwargs)

    setattr(target, name, stuck)
    assert engine.stage_watches[stage].limit_s == math.inf
    engine.stage_watches[stage].limit_s = 2.0
    try:
        events = run(collect(engine, SongRequest("pop", "[verse]\nla", 1.0, 1, 1, id="stuck")))
        assert isinstance(events[-1], Failed) and events[-1].message.startswith(f"{stage} has been in one")
        assert "counts as hung" in events[-1].message and engine.unavailable() == events[-1].message
        with pytest.raises(Music3Error, match="counts as hung"):
            run(collect(engine, SongRequest("pop", "[verse]\nla", 1.0, 2, 1, id="after")))
        started = time.monotonic()
        engine.close()
        assert time.monotonic() - started < 10  # the other threads' joins only
    finally:
        release.set()  # the stuck thread returns, and ends as the engine is closed
        for thread in engine._threads:
            thread.join(timeout=30)
        shut(engine)


def test_time_the_process_spends_paused_does_not_count_for_a_stage_call():
    watch = StageWatch(limit_s=5.0, call="frame step")
    assert watch.hung() is None
    watch.busy(1.0)
    watch._call = (watch._call[0] - 8.0, 1.0)  # 8 s into the call
    assert watch.hung() == "has been in one frame step for 8 s"
    watch.paused(6.0)  # six of them with the process paused (say a frozen container)
    assert watch.hung() is None
    watch.busy(None)
    watch.paused(6.0)
    assert watch.hung() is None


def test_a_stage_calls_limit_is_per_unit_of_its_work():
    """A call of 10 units of work may run ten times limit_s before it counts as hung."""
    watch = StageWatch(limit_s=1.0, call="render call ({work:g} windows' work)")
    watch.busy(10.0)
    watch._call = (watch._call[0] - 8.0, 10.0)  # 8 s into the call
    assert watch.hung() is None
    watch._call = (watch._call[0] - 4.0, 10.0)  # 12 s
    assert watch.hung() == "has been in one render call (10 windows' work) for 12 s"


def test_once_the_engine_closes_the_local_stage_1_stops_at_its_next_take():
    """Closing, what stage 1's thread takes ends with a stop: it does not render the whole queue first."""
    closing = threading.Event()
    stage = LocalStage1(SimpleNamespace(stream=None), lambda chunk: None, lambda song, message: None, closing,
                        StageWatch(limit_s=1.0, call="render call"))
    stage.send("window 0 of a", None)
    assert stage._take(block=False) == [("window", "window 0 of a")]
    stage.send("window 1 of a", None)
    closing.set()
    assert stage._take(block=False) == [("window", "window 1 of a"), ("stop",)]


def test_without_async_chunk_and_codec_streaming_a_song_arrives_whole_after_its_last_frame(models, deploy, solo):
    """async_chunk false: stage 1 gets a song's windows only after its last frame; codec_streaming false: the
    client gets the song's PCM as one chunk at the end. The audio is the streamed song's."""
    name = deploy.stages[0].output_connectors["to_stage_1"]
    connector = deploy.connectors[name]
    quiet = dataclasses.replace(connector, extra=dataclasses.replace(connector.extra, codec_streaming=False))
    engine = make_engine(models, dataclasses.replace(deploy, async_chunk=False, connectors={**deploy.connectors,
                                                                                             name: quiet}))
    try:
        windows_at_stage1: list[bool] = []  # per render call: was the song still in the talker?
        real = engine.renderer.render

        def render(batch):
            windows_at_stage1.append("whole" in callers(engine.talker.songs))
            return real(batch)

        engine.renderer.render = render
        events = run(collect(engine, request(7, id="whole")))  # 9 s: two windows
    finally:
        shut(engine)
    accepted, chunk, done = events
    assert isinstance(accepted, Accepted) and isinstance(done, Done)
    assert isinstance(chunk, AudioChunk) and chunk.window == 0 and chunk.last
    assert windows_at_stage1 == [False, False]
    assert np.array_equal(chunk.pcm, pcm(solo(7)))


def test_songs_are_taken_only_while_their_whole_audio_fits_beside_what_callers_have_not_read(engine, monkeypatch):
    """A song is held only if all its audio fits in max_unread_bytes beside what the songs held may still queue for
    their callers: a crowd of slow readers cannot fill the host's memory (it was checked against audio already
    written only, so songs taken meanwhile queued 21x the limit). Past it, a submit raises EngineBusy (HTTP 429);
    a song larger than the whole limit is refused as such; once read, songs are taken again."""
    audio = {seconds: song_samples(int(seconds * contract.FRAME_RATE)) * PCM_BYTES_PER_SAMPLE for seconds in (2, 3, 4)}
    monkeypatch.setattr(engine, "max_unread_bytes", audio[4] + audio[2])

    async def scenario() -> None:
        slow = engine.submit(request(0, duration_s=4.0, id="slow-reader"))
        try:
            assert isinstance(await next_event(slow), Accepted)  # and then not read until its song is written
            with pytest.raises(EngineBusy, match="callers have not read; this song's .* would pass"):
                await next_event(engine.submit(request(1, duration_s=3.0, id="refused")))
            beside = await collect(engine, request(1, duration_s=2.0, id="fits"))
            assert isinstance(beside[-1], Done), beside[-1]
            key = engine.held.key_of("slow-reader")
            await wait_until(lambda: engine.held.client(key).events.qsize() >= 2, "the slow reader's song is written")
            with pytest.raises(EngineBusy, match="not read"):
                await next_event(engine.submit(request(1, duration_s=3.0, id="still-refused")))
            while not isinstance(await next_event(slow), Done):  # the caller reads its song
                pass
        finally:
            await close_stream(slow)
        events = await collect(engine, request(1, duration_s=3.0, id="taken"))
        assert isinstance(events[0], Accepted) and isinstance(events[-1], Done)
        with pytest.raises(InputError, match=r"a song of 8 s is .* MiB of audio, more than the engine holds"):
            await next_event(engine.submit(request(1, duration_s=8.0, id="too-long")))

    run(scenario())


def test_a_song_whose_audio_is_exactly_the_engines_limit_is_taken(engine, monkeypatch):
    """max_unread_bytes is the most audio the engine holds: a song of exactly that much fits."""
    monkeypatch.setattr(engine, "max_unread_bytes", song_samples(contract.FRAME_RATE) * PCM_BYTES_PER_SAMPLE)  # 1 s
    events = run(collect(engine, request(0, duration_s=1.0, id="exactly-the-limit")))
    assert isinstance(events[0], Accepted) and isinstance(events[-1], Done), events[-1]


def test_audio_a_caller_has_read_no_longer_counts_against_the_songs_it_holds(engine, monkeypatch):
    """A song's reservation shrinks by each chunk its caller reads: beside a song whose caller keeps up, a song that
    fits only thanks to what was read is taken before the first ends (the whole reservation kept until the end
    refused it)."""
    audio = {seconds: song_samples(int(seconds * contract.FRAME_RATE)) * PCM_BYTES_PER_SAMPLE for seconds in (2, 8.4)}
    monkeypatch.setattr(engine, "max_unread_bytes", audio[8.4] + audio[2] - 1)

    async def scenario() -> None:
        reader = engine.submit(request(0, duration_s=8.4, id="keeps-up"))  # 210 frames, two windows: two chunks
        try:
            assert isinstance(await next_event(reader), Accepted)
            with pytest.raises(EngineBusy, match="not read"):
                await next_event(engine.submit(request(1, duration_s=2.0, id="too-early")))
            while not isinstance(chunk := await next_event(reader), AudioChunk):
                pass
            held = engine.held.client(engine.held.key_of("keeps-up"))
            assert held.unread_bytes == audio[8.4] - chunk.pcm.nbytes > 0
            fits = engine.submit(request(1, duration_s=2.0, id="fits-once-read"))
            try:
                assert isinstance(await next_event(fits), Accepted)
                # taken while the first song's stream is still held
                assert engine.held.client(engine.held.key_of("keeps-up")) is held
            finally:
                await close_stream(fits)
        finally:
            await close_stream(reader)

    run(scenario())


def test_stage_messages_name_songs_by_the_callers_ids_not_the_engines_keys():
    """A stage quotes a song by its key ('id#n', HeldSongs.new_key); the caller's Failed names the id it gave."""
    message = "stage 1 lost a window of song 'ab#7' (and of 'c.d-e#12'); 'plain' and 'x#y' are no keys"
    assert callers_ids(message) == "stage 1 lost a window of song 'ab' (and of 'c.d-e'); 'plain' and 'x#y' are no keys"
    apostrophe, quotes = "it's", 'say "hi"'  # repr() quotes these with ", and with ' and escapes
    quoted = f"song {apostrophe + '#3'!r} and {quotes + '#4'!r} failed"
    assert callers_ids(quoted) == f"song {apostrophe!r} and {quotes!r} failed"


def test_a_song_whose_windows_stage_1_answers_within_send_still_ends_done(models, deploy):
    """The talker emits a song's last window before its SongFinished, in one step; the engine takes the SongFinished
    first, so a stage 1 that renders and answers a window inside send() (no queue between) finds the song finished
    (its Done needs the frame count), where the talker thread died on it and the song failed."""
    engine = make_engine(models, deploy)

    def at_once(payload, ready) -> None:
        for out in engine.renderer.render([payload]):
            engine.reports.on_chunk(out)

    engine.stage1.send = at_once
    try:
        events = run(collect(engine, request(0, duration_s=1.0, id="at-once")))
    finally:
        shut(engine)
    assert isinstance(events[-1], Done) and events[-1].frames == 25, events[-1]
    assert engine.unavailable() == "the engine is closed"


def test_cancel_takes_a_string_id_and_ignores_one_not_held(engine):
    assert engine.cancel("nobody") is False
    with pytest.raises(InputError, match=r"cancel takes a song's id \(a string\), got list: \[\]"):
        engine.cancel([])  # unhashable: it raised a bare TypeError


def test_a_stream_read_on_another_event_loop_is_refused_clearly_and_its_song_freed(engine):
    first = asyncio.new_event_loop()
    try:
        stream = engine.submit(request(0, id="two-loops"))
        assert isinstance(first.run_until_complete(next_event(stream)), Accepted)
        with pytest.raises(RuntimeError, match="read on the event loop that started it, not another"):
            run(next_event(stream))  # asyncio's "bound to a different event loop" from deep inside, before
        run(wait_until(lambda: "two-loops" not in callers(engine.talker.songs), "the talker drops the song"))
        assert engine.held.key_of("two-loops") is None
    finally:
        first.close()


def test_an_engine_used_as_a_context_manager_is_closed_after(models, deploy):
    with Engine(models, deploy) as engine:
        assert isinstance(run(collect(engine, request(0, duration_s=1.0)))[-1], Done)
    assert not any(thread.is_alive() for thread in engine._threads)
    with pytest.raises(Music3Error, match="closed"):
        run(next_event(engine.submit(request(0))))


def test_a_stage_placed_on_a_gpu_the_machine_lacks_is_refused_before_loading(monkeypatch):
    from music3serve.serving.deploy_config import parse_deploy_config
    from music3serve.serving.deploy_yaml import read_deploy_yaml

    data, source = read_deploy_yaml(None)
    data["stages"][1]["devices"] = "7"
    deploy = parse_deploy_config(data, source)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("music3serve.serving.engine.load_models", lambda *a, **k: pytest.fail("models loaded"))
    with pytest.raises(Music3Error, match=r"stage 1 is placed on GPU 7 .* has 2 CUDA device\(s\): 0 to 1"):
        Engine.from_pretrained("unused", deploy)


def test_a_device_override_that_puts_both_stages_on_one_gpu_checks_their_memory_shares(monkeypatch):
    """The file's check that stages on one GPU share at most all of it saw two GPUs; --device cuda puts both on one."""
    from music3serve.serving.deploy_config import parse_deploy_config
    from music3serve.serving.deploy_yaml import read_deploy_yaml

    data, source = read_deploy_yaml(None)
    for stage, gpu in zip(data["stages"], ("0", "1")):
        stage["devices"], stage["gpu_memory_utilization"] = gpu, 0.8
    deploy = parse_deploy_config(data, source)
    monkeypatch.setattr("music3serve.serving.engine.load_models", lambda *a, **k: pytest.fail("models loaded"))
    with pytest.raises(Music3Error, match=r"both stages run on cuda:0 .* add up to 1\.6 > 1"):
        Engine.from_pretrained("unused", deploy, device="cuda:0")


def load_models_arguments(monkeypatch, *args, **kwargs) -> dict:
    """What Engine.from_pretrained("unused", *args, **kwargs) hands load_models (stopped there: no model loads)."""
    loaded = {}

    def fake_load_models(root, device, talker_dtype, acoustic, progress, quantization):
        loaded.update(device=device, talker_dtype=talker_dtype, acoustic=acoustic, quantization=quantization)
        raise RuntimeError("stop before building the engine")

    monkeypatch.setattr("music3serve.serving.engine.load_models", fake_load_models)
    with pytest.raises(RuntimeError, match="stop before"):
        Engine.from_pretrained("unused", *args, **kwargs)
    return loaded


@pytest.mark.parametrize("override", ["cpu", "cpu:0", torch.device("cpu"), "cuda:1", torch.device("cuda", 1)])
def test_any_spelling_of_a_device_override_loads_the_talker_in_the_dtype_of_its_kind(monkeypatch, override):
    """The CPU runs the talker in float32 however it is named ("cpu:0" and torch.device("cpu") took the deploy file's
    bfloat16, another song for the same seed); the override reaches the loader as a device string."""
    loaded = load_models_arguments(monkeypatch, device=override)
    cpu = torch.device(override).type == "cpu"
    assert (loaded["device"], loaded["talker_dtype"]) == (str(torch.device(override)),
                                                          torch.float32 if cpu else torch.bfloat16)


@pytest.mark.parametrize("override", ["gpu", "cuda:x", 3.5])
def test_a_device_override_that_names_no_device_is_refused(monkeypatch, override):
    monkeypatch.setattr("music3serve.serving.engine.load_models", lambda *a, **k: pytest.fail("models loaded"))
    with pytest.raises(Music3Error, match="device override .* is not a torch device"):
        Engine.from_pretrained("unused", device=override)


@pytest.mark.parametrize("cuda", [False, True])
def test_stages_on_different_gpus_split_only_where_there_are_gpus(monkeypatch, cuda):
    """The seed layout (stage 1 on another GPU) runs split on a machine with two GPUs; on a machine without CUDA both
    stages run on the CPU in one process instead of two CPU processes."""
    from music3serve.serving.deploy_config import parse_deploy_config
    from music3serve.serving.deploy_yaml import read_deploy_yaml

    data, source = read_deploy_yaml(None)
    data["stages"][0]["devices"], data["stages"][1]["devices"] = "0", "1"
    deploy = parse_deploy_config(data, source)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    loaded = load_models_arguments(monkeypatch, deploy)
    assert (loaded["device"], loaded["acoustic"]) == (("cuda:0", False) if cuda else ("cpu", True))


def test_the_renderer_captures_the_stage_1_sizes_the_deploy_config_names(models, deploy, monkeypatch):
    """Stage 1's cudagraph_capture_sizes are the window batches captured at startup (they were ignored: every size
    up to the render batch was captured); a batch of another size runs eagerly."""
    from music3serve.acoustic.renderer import Renderer

    stage1 = dataclasses.replace(deploy.stages[1], compilation_config=dataclasses.replace(
        deploy.stages[1].compilation_config, cudagraph_capture_sizes=(8, 2)))
    warmed = []
    monkeypatch.setattr(Renderer, "warmup", lambda self, batches, *a, **k: warmed.append(tuple(batches)))
    shut(Engine(models, dataclasses.replace(deploy, stages=(deploy.stages[0], stage1))))
    assert warmed == [(8, 2)]


def test_close_mid_song_leaves_nothing_held_in_either_stage(models, deploy):
    async def start_a_song(engine: Engine) -> None:
        stream = engine.submit(request(0, duration_s=12.0))
        assert isinstance(await next_event(stream), Accepted)
        await wait_until(lambda: engine.talker.frames_written > 0, "the talker writes a frame")
        shut(engine)  # with the song's stream still open on this loop
        # The open stream ends with Failed("engine closed"), where a caller of the Python API waited forever (a
        # window rendered before the close may come first).
        while isinstance(event := await asyncio.wait_for(stream.__anext__(), 30), AudioChunk):
            pass
        assert isinstance(event, Failed) and event.message == "engine closed", event

    engine = make_engine(models, deploy)
    try:
        run(start_a_song(engine))
    finally:
        shut(engine)
    assert not engine.talker.songs and not engine.talker.busy and engine.renderer.songs == []


def test_a_songs_reservation_shrinks_to_its_frame_budget_once_accepted(engine):
    """A long prompt leaves fewer frames within max_model_len than a long song asks for: from acceptance on, the
    song holds room for the audio of its budget, not of its request."""
    req = request(0, duration_s=360.0, lyrics="[verse]\n" + "la " * 1500, id="capped")

    async def scenario() -> None:
        stream = engine.submit(req)
        try:
            accepted = await next_event(stream)
            assert isinstance(accepted, Accepted) and accepted.budget_frames < 9000  # capped by the context
            held = engine.held.client(engine.held.key_of("capped"))
            assert held.unread_bytes == song_samples(accepted.budget_frames) * PCM_BYTES_PER_SAMPLE
        finally:
            await close_stream(stream)

    run(scenario())


def test_a_song_whose_prefill_fails_is_accepted_then_failed(engine, monkeypatch) -> None:
    """The talker takes the song (Accepted, with its budget: a request served, not refused) and its prefill then runs
    out of memory: the caller gets Accepted, then Failed with the talker's reason under its own id (not refused, so
    HTTP reports a failed song, not a bad request), and nothing else; the song is counted as one request and one
    failure, and its id and rows are free again."""
    monkeypatch.setattr(engine.talker, "lm", FailingPrefill(engine.talker.lm))
    req = request(0, id="prefill-fails")
    before = samples(engine)
    events = run(collect(engine, req))
    assert [type(e) for e in events] == [Accepted, Failed], events
    accepted, failed = events
    assert accepted.song == failed.song == "prefill-fails" and accepted.seed == req.seed
    assert accepted.prompt_tokens == prompt_tokens(engine, req) and accepted.budget_frames == 50
    assert failed.message == "stage 0 could not prefill the song: out of memory for this prompt (test)"
    assert not failed.refused
    after = samples(engine)
    assert after["music3_requests_total"] == before["music3_requests_total"] + 1
    assert after["music3_failures_total"] == before["music3_failures_total"] + 1
    invalid = 'music3_refusals_total{reason="invalid"}'
    assert after[invalid] == before[invalid]
    assert engine.held.key_of("prefill-fails") is None and not engine.talker.busy


def test_a_song_whose_callers_event_loop_is_gone_is_cancelled_in_both_stages(engine, monkeypatch) -> None:
    """A caller reads its song's Accepted, then its event loop closes with the stream left open (say the thread that
    ran it ended): window 0's audio finds nobody listening, and the song is forgotten and cancelled at once. Forgotten
    only, the talker decoded the rest of the song for nobody and stage 1 kept its carry for good (its later windows
    were no longer sent, the last included)."""
    assert engine.deploy.connector.extra.codec_streaming  # window 0's AudioChunk is what finds the loop gone
    poll_until(lambda: not (engine.talker.busy or engine.held or engine.renderer.songs), EVENT_TIMEOUT)
    budget, real_step = 750, engine.talker.step  # 30 s; window 0 goes to stage 1 at frame 201

    def song_state() -> object | None:  # the talker's state of the song, while it holds it
        return next((s for s in list(engine.talker.songs.values()) if caller_id(s.id) == "loop-gone"), None)

    # The talker waits at frame 220 (window 0 went to stage 1 at 201) until window 0's audio has found the loop gone:
    # however slow the render, the song is mid-way when it is forgotten.
    def step_once_window_0_is_out() -> list:
        song, deadline = song_state(), time.monotonic() + EVENT_TIMEOUT
        while (song is not None and song.frames >= 220 and engine.held.client(song.id) is not None
               and time.monotonic() < deadline):
            time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(engine.talker, "step", step_once_window_0_is_out)
    frames, loop = engine.talker.frames_written, asyncio.new_event_loop()
    stream = engine.submit(request(0, id="loop-gone", duration_s=budget / contract.FRAME_RATE))
    try:
        accepted = loop.run_until_complete(next_event(stream))
    finally:
        loop.close()  # the stream left open
    assert isinstance(accepted, Accepted) and accepted.budget_frames == budget
    poll_until(lambda: song_state() is None, EVENT_TIMEOUT)
    assert engine.talker.frames_written - frames < budget, "the talker decoded the whole song for nobody"
    poll_until(lambda: not (engine.renderer.songs or engine.talker.busy), EVENT_TIMEOUT)  # the step in flight ends
    assert not engine.held and engine.held.key_of("loop-gone") is None


def test_a_song_stage_0_cannot_take_fails_alone_and_the_engine_serves_the_next(engine, monkeypatch) -> None:
    """talker.submit raises something other than InputError (say a device error) after it queued the song: that song
    alone fails, as a failure (not refused, and not counted as a request) with "stage 0 could not take the song" and
    the reason, the talker holds nothing of it by the time its caller hears, and the engine serves the next song."""
    real_submit = engine.talker.submit

    def submit_then_fail(song: str, *args) -> int:
        budget = real_submit(song, *args)
        if caller_id(song) == "untakeable":
            raise RuntimeError("injected device error while queueing")
        return budget

    monkeypatch.setattr(engine.talker, "submit", submit_then_fail)
    before = samples(engine)

    async def scenario() -> tuple[Event, list[str], list]:
        stream = engine.submit(request(0, id="untakeable", duration_s=30.0))  # 750 frames: long in the talker
        try:
            failed = await next_event(stream)
            held = list(engine.talker.songs)  # before the stream's end cancels whatever is left of the song
        finally:
            await close_stream(stream)
        return failed, held, await collect(engine, request(0, id="taken-next"))

    failed, held, events = run(scenario())
    assert isinstance(failed, Failed) and failed.song == "untakeable" and not failed.refused, failed
    assert failed.message == "stage 0 could not take the song: injected device error while queueing"
    assert "untakeable" not in callers(held)
    check_stream(events, request(0, id="taken-next"), prompt_tokens(engine, SONGS[0]))
    after = samples(engine)
    assert after["music3_failures_total"] == before["music3_failures_total"] + 1
    assert after["music3_requests_total"] == before["music3_requests_total"] + 1  # the next song only
    invalid = 'music3_refusals_total{reason="invalid"}'
    assert after[invalid] == before[invalid]
    assert engine.held.key_of("untakeable") is None


def test_the_start_up_line_names_the_talkers_real_dtype(engine, deploy):
    """The deploy file's bf16 talker runs in float32 on the CPU: the start-up line says so, not the file's dtype."""
    assert deploy.stages[0].dtype == "bfloat16" and engine.models.language_model.embed.weight.dtype == torch.float32
    said = deploy.precisions(talker_dtype="float32")
    assert said["stage 0"] == "float32 (on this device; the deploy file's bfloat16 applies on GPUs)"
    fp8 = with_quantization(deploy, "fp8").precisions(talker_dtype="float32")["stage 0"]
    assert fp8.startswith("fp8:") and "float32 activations and KV" in fp8  # FP8 on the CPU too
    assert said["stage 1"] == deploy.precisions()["stage 1"]
    assert deploy.precisions(talker_dtype="bfloat16") == deploy.precisions()


def test_a_song_whose_lyrics_lose_text_after_a_tag_is_logged_by_id(engine, caplog):
    """The reference drops text after a [tag] on its line; the engine serves the song and logs the lines by number
    with the song's id (no lyrics in the log)."""
    req = request(0, lyrics="[verse] neon skies\nhold on\n[chorus]\nhey", duration_s=1.0, id="tagline")
    with caplog.at_level("WARNING", logger="music3serve.prompt"):
        events = run(collect(engine, req))
    assert isinstance(events[-1], Done)
    warned = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert [(r.lines, r.song) for r in warned] == [([1], "tagline")]
