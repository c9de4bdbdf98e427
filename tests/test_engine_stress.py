"""The engine under adversarial concurrent use on the tiny checkpoint: colocated, split, and colocated with whole songs
(async_chunk and codec_streaming off).

A seeded random schedule runs more songs than the talker has rows (they queue), cancels them at random moments
(before acceptance, while queued, mid-stream, while stage 1 holds their carry, while the engine hands their window to
stage 1, after the end, twice, unknown ids), breaks out of `async for` early, interleaves requests refused before
queueing and by the talker, and submits an id again right after its song was cancelled. Every stream must end within
a bound; afterwards the talker, the renderer and the engine hold nothing, the split layout leaves no segment in
/dev/shm, the metrics count exactly what happened, and the songs left alone sound as they do solo. The schedule is
fixed by its seed; the threads' timing is not, so each act accepts every ending its cancel can race into.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import pytest

from music3serve.errors import InputError
from music3serve.serving.deploy_config import parse_deploy_config
from music3serve.serving.engine import Engine
from music3serve.serving.events import Accepted, AudioChunk, Done, Failed, SongRequest
from music3serve.serving.worker import windows_in_flight
from shm_names import segments
from song_keys import caller_id
from test_engine import pcm, wait_until  # the engine tests' helpers (tests/ is on the import path: no package)

EVENT_TIMEOUT = 30.0  # seconds for any one event; the tiny model needs well under one
RUN_TIMEOUT = 120.0
# Batched vs solo PCM differs by float32 rounding only (tests/test_engine.py measured 7.4e-5 at worst).
PCM_MAX_ABS = 1.5e-4
# Two songs at once (4 rows), two windows per render call, prompts prefilled 12 tokens a step (several steps each),
# and a context a long prompt does not fit in (the talker refuses it).
DEPLOY = {"stages": [{"stage_id": 0, "max_num_seqs": 4, "max_model_len": 320, "max_num_batched_tokens": 24},
                     {"stage_id": 1, "max_num_seqs": 2}]}
# Stage 1 gets a song's windows after its last frame, and its caller the PCM in one chunk at the end.
WHOLE = {"async_chunk": False, "connectors": {"connector_of_shared_memory": {
    "name": "SharedMemoryConnector", "extra": {"codec_streaming": False}}}}
LAYOUTS = {"colocated": (11, False, {}), "split": (12, True, {}), "whole songs": (13, False, WHOLE)}  # seed, split
KINDS = ("full", "cancel_early", "cancel_mid", "cancel_carry", "at_window", "break_early", "after_done", "invalid",
         "refused", "reuse")
LONG = ("cancel_carry", "at_window")  # two-window songs (201 frames before their first window): once each
INVALID = [dict(caption=""), dict(duration_s=0.0), dict(steps=0), dict(seed=-1), dict(id="")]
SHORT, TWO_WINDOWS = (0.5, 1.0, 1.5, 2.0), 9.0  # seconds; 9 s is 225 frames: window 0 goes out at frame 201


@dataclass(frozen=True)
class Act:
    """One caller: submit `request` at `start_s`, then act as `kind` says (Storm's method of that name)."""

    kind: str
    start_s: float
    request: SongRequest
    reads: int = 0  # events read before cancelling or breaking out
    pause_s: float = 0.0  # then wait this long before cancelling
    again: SongRequest | None = None  # "reuse": submitted under the same id right after the cancelled song ends


def song(rng: random.Random, name: str, durations: tuple[float, ...] = SHORT) -> SongRequest:
    caption = rng.choice(["pop", "dreamy synth-pop", "jazz trio", "metal"])
    lyrics = "[verse]\n" + " ".join(rng.choice(["la", "hey", "neon", "skies"]) for _ in range(rng.randint(1, 12)))
    return SongRequest(caption, lyrics, rng.choice(durations), seed=rng.randrange(1000), steps=rng.choice([1, 2]),
                       id=name)


def schedule(seed: int, extra: int = 6) -> list[Act]:
    """Two songs left alone from the start (compared with their solo runs), then a caller of each kind and `extra`
    more of random kinds, in a random order, half of them at once."""
    rng = random.Random(seed)
    plan = [Act("full", 0.0, song(rng, f"keep-{i}")) for i in range(2)]
    kinds = [*KINDS, *rng.choices([k for k in KINDS if k not in LONG], k=extra)]
    for i, kind in enumerate(rng.sample(kinds, len(kinds))):
        name, start = f"{i}-{kind}", 0.0 if i % 2 else rng.uniform(0.0, 1.5)
        request = song(rng, name, (TWO_WINDOWS,) if kind in LONG else SHORT)
        if kind == "invalid":
            request = replace(request, **rng.choice(INVALID))
        elif kind == "refused":
            request = replace(request, lyrics="[verse]\n" + "la " * 400)  # over max_model_len
        again = song(rng, name) if kind == "reuse" else None
        plan.append(Act(kind, start, request, rng.randint(1, 2), rng.choice([0.0, 0.05, 0.3]), again))
    return plan


# Reading streams.
async def next_event(stream):
    return await asyncio.wait_for(stream.__anext__(), EVENT_TIMEOUT)


async def read(stream, events: list, count: int | None = None) -> bool:
    """Append up to `count` more events (all when None); whether the stream has ended."""
    while count is None or count > 0:
        try:
            events.append(await next_event(stream))
        except StopAsyncIteration:
            return True
        count = None if count is None else count - 1
    return ended(events)


def ended(events: list) -> bool:
    return bool(events) and isinstance(events[-1], (Done, Failed))


def check_stream(events: list, song: str, endings: tuple[type, ...]) -> None:
    """Accepted, AudioChunk windows 0.. in order (last only on the final one), then one ending of `endings`; a
    cancelled stream may end anywhere after Accepted, or before it."""
    names = [type(e).__name__ for e in events]
    assert events, f"{song}: the stream ended without an event"
    *body, end = events
    assert all(e.song == song for e in events), events
    assert isinstance(end, endings), f"{song}: ended with {end!r}, expected one of {endings}"
    if isinstance(end, Failed):
        assert end.message == "cancelled" or end.refused, f"{song}: {end.message}"
        assert not end.refused or body == [], f"{song}: a refused song got {names}"
    assert not body or isinstance(body[0], Accepted), f"{song}: {names}"
    chunks = body[1:]
    assert all(isinstance(c, AudioChunk) for c in chunks), f"{song}: {names}"
    assert [c.window for c in chunks] == list(range(len(chunks))), f"{song}: windows {[c.window for c in chunks]}"
    assert not any(c.last for c in chunks[:-1]), f"{song}: a chunk before the last says last"
    assert not isinstance(end, Done) or (chunks and chunks[-1].last), f"{song}: Done without its last chunk"


# The callers.
class Storm:
    """Plays a schedule on an engine. `kept` collects the songs to compare with their solo runs, `expected` what
    the engine's metrics must count (`expected["requests"]` at most: `early` of them may be cancelled before the
    talker takes them, and are never accepted); cancels are known within bounds: a caller that stops reading may do
    so after its song's Done is on its way, and such a song counts as done, not cancelled."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.kept: dict[str, tuple[SongRequest, list]] = {}
        self.ids: set[str] = set()  # of every song submitted
        self.expected = {"requests": 0, "refused": 0, "failures": 0}
        self.cancels = [0, 0]  # at least, at most
        self.early = 0  # songs cancelled as soon as the engine holds them
        # Songs whose caller goes away while the engine hands their first window to stage 1: set once it has gone.
        self.doomed: dict[str, threading.Event] = {}
        if engine.worker is None:
            window = lambda item: item[1] if item[0] == "window" else None  # noqa: E731
            engine.stage1.windows.put = self.handing_over(engine.stage1.windows.put, window)
        else:
            engine.worker.send_window = self.handing_over(engine.worker.send_window, lambda payload: payload)

    def handing_over(self, send: Callable, payload: Callable) -> Callable:
        """`send` (the engine's hand-over to stage 1, after it checked that the song is still wanted), except that a
        doomed song's caller cancels and closes its stream first (on a GPU this is the window's copy to the host)."""

        def send_after_the_caller_went(item) -> None:
            window = payload(item)
            gone = self.doomed.pop(caller_id(window.song), None) if window is not None else None
            if gone is not None:
                self.engine.cancel(caller_id(window.song))
                gone.wait(EVENT_TIMEOUT)
            send(item)

        return send_after_the_caller_went

    async def play(self, act: Act) -> None:
        await asyncio.sleep(act.start_s)
        self.ids.add(act.request.id)
        self.engine.cancel(f"ghost-{act.request.id}")  # an id the engine never held
        try:
            await getattr(self, act.kind)(act)
        except asyncio.TimeoutError:
            raise AssertionError(f"{act.kind} {act.request.id}: no event for {EVENT_TIMEOUT:g} s; the engine holds "
                                 f"{leftovers(self.engine, self.ids)}") from None

    def cancel_id(self, song: str, times: int = 1) -> None:
        """engine.cancel(song) `times` times: the first counts if it cancelled the song, the others change nothing."""
        self.count_cancel(self.engine.cancel(song))
        for _ in range(times - 1):
            assert not self.engine.cancel(song)

    def count_cancel(self, sure: bool, possible: bool | None = None) -> None:
        self.cancels[0] += sure
        self.cancels[1] += sure if possible is None else possible

    async def full(self, act: Act) -> None:
        events = await self.whole(act.request)
        check_stream(events, act.request.id, (Done,))
        self.kept[act.request.id] = (act.request, events)

    async def after_done(self, act: Act) -> None:
        events = await self.whole(act.request)
        check_stream(events, act.request.id, (Done,))
        self.cancel_id(act.request.id, times=2)  # the song has ended: nothing to cancel, nothing counted

    async def cancel_early(self, act: Act) -> None:
        """Cancel as soon as the engine holds the id: before the talker took the song, or just after."""
        events = asyncio.ensure_future(self.whole(act.request))
        held = self.engine.held
        await wait_until(lambda: held.key_of(act.request.id) is not None, "the engine holds the song", EVENT_TIMEOUT)
        self.cancel_id(act.request.id)
        self.early += 1
        check_stream(await events, act.request.id, (Failed, Done))

    async def cancel_mid(self, act: Act) -> None:
        check_stream(await self.cancelled(act), act.request.id, (Failed, Done))

    async def cancel_carry(self, act: Act) -> None:
        """Cancelled after its first window's audio, while stage 1 holds the song's overlap carry."""
        await self.cancel_mid(replace(act, reads=2))

    async def reuse(self, act: Act) -> None:
        """Cancel, and once the stream has ended submit another song under the same id: it is a song of its own."""
        check_stream(await self.cancelled(act), act.request.id, (Failed, Done))
        again = await self.whole(act.again)
        check_stream(again, act.again.id, (Done,))
        self.kept[f"{act.again.id}-again"] = (act.again, again)

    async def at_window(self, act: Act) -> None:
        """Cancelled, its stream read to the end and closed, while the engine hands its first window to stage 1."""
        gone = self.doomed[act.request.id] = threading.Event()
        events = await self.whole(act.request)
        gone.set()
        self.count_cancel(True)  # cancelled before its first window reached stage 1: it cannot have ended
        check_stream(events, act.request.id, (Failed,))

    async def break_early(self, act: Act) -> None:
        """Stop iterating early: the generator, dropped, is closed by the event loop, which cancels the song."""
        events = []
        self.expected["requests"] += 1
        async for event in self.engine.submit(act.request):
            events.append(event)
            if len(events) == act.reads:
                break
        self.count_cancel(False, possible=not ended(events))
        cut = [] if ended(events) else [Failed(act.request.id, "cancelled")]  # where the caller stopped reading
        check_stream([*events, *cut], act.request.id, (Failed, Done))

    async def invalid(self, act: Act) -> None:
        stream = self.engine.submit(act.request)
        with pytest.raises(InputError):
            await next_event(stream)
        await stream.aclose()
        self.expected["refused"] += 1

    async def refused(self, act: Act) -> None:
        events = await self.whole(act.request)
        check_stream(events, act.request.id, (Failed,))
        assert events[-1].refused and "max_model_len" in events[-1].message, events[-1]
        self.expected["requests"] -= 1  # whole() counted it
        self.expected["refused"] += 1

    async def whole(self, request: SongRequest) -> list:
        stream, events = self.engine.submit(request), []
        self.expected["requests"] += 1
        try:
            await read(stream, events)
        finally:
            await stream.aclose()
        return events

    async def cancelled(self, act: Act) -> list:
        """Read `act.reads` events, wait `act.pause_s`, cancel (twice, for some), read to the end."""
        stream, events = self.engine.submit(act.request), []
        self.expected["requests"] += 1
        try:
            if not await read(stream, events, act.reads):
                await asyncio.sleep(act.pause_s)
                self.cancel_id(act.request.id, times=1 + act.reads % 2)
                await read(stream, events)
        finally:
            await stream.aclose()
        return events


# What must be left once every stream has ended.
def leftovers(engine: Engine, ids: Iterable[str]) -> dict[str, object]:
    """Everything the engine or a stage still holds for some song (empty when all is freed); `ids`: the songs'."""
    talker = engine.talker
    held = {
        "engine clients": engine.held.held_keys(), "engine ids": [i for i in ids if engine.held.key_of(i) is not None],
        "talker songs": list(talker.songs), "talker active": [s.id for s in talker.active],
        "talker waiting": [s.id for s in talker.waiting], "talker busy": talker.busy,
    }
    if engine.worker is None:
        held |= {"renderer songs": engine.renderer.songs, "windows queued": engine.stage1.windows.qsize()}
    else:
        worker = engine.worker
        slots = windows_in_flight(engine.deploy.stages[1].render_batch)
        held |= {
            "connector waits": dict(worker.deadlines.songs), "outbox skips": list(worker.outbox._skipped),
            "window slots taken": slots - worker.outbox.slots.get_value(), "segments": segments(worker.connector),
        }
    return {what: value for what, value in held.items() if value}


async def quiet(engine: Engine, ids: Iterable[str], timeout: float = 10.0) -> dict[str, object]:
    """Wait until the engine holds nothing (a closed stream cancels its song a moment later); what it still holds."""
    deadline = time.monotonic() + timeout
    while (left := leftovers(engine, ids)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return left


def counted(engine: Engine) -> dict[str, float]:
    value = engine.metrics.registry.get_sample_value
    return {"requests": value("music3_requests_total"), "cancels": value("music3_cancels_total"),
            "refused": value("music3_refusals_total", {"reason": "invalid"}),
            "failures": value("music3_failures_total"), "done": value("music3_song_seconds_count")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_storm_of_songs_cancels_and_bad_requests_ends_every_stream_and_frees_everything(tiny_dir: Path, layout: str):
    seed, split, changes = LAYOUTS[layout]
    deploy = parse_deploy_config(DEPLOY | changes, f"stress test deploy, {layout}")
    engine = Engine.from_pretrained(tiny_dir, deploy, device="cpu", split=split)
    connector = engine.worker.connector if engine.worker is not None else None
    storm = Storm(engine)

    async def scenario():
        await asyncio.gather(*(storm.play(act) for act in schedule(seed)))
        left = await quiet(engine, storm.ids)
        solo = {name: await storm.whole(replace(req, id=f"solo-{name}")) for name, (req, _) in storm.kept.items()}
        return left, solo

    try:
        left, solo = asyncio.run(asyncio.wait_for(scenario(), RUN_TIMEOUT))
        assert left == {}, f"still held after every stream ended: {left}"
        got = counted(engine)
        unaccepted = storm.expected["requests"] - got["requests"]  # cancelled before the talker took them
        assert 0 <= unaccepted <= storm.early, (got, storm.expected, storm.early)
        exact = ("refused", "failures")
        assert {what: got[what] for what in exact} == {what: storm.expected[what] for what in exact}
        assert storm.cancels[0] <= got["cancels"] <= storm.cancels[1], (got, storm.cancels)
        # Each song ended once: done or cancelled (those never accepted, cancelled).
        assert got["cancels"] + got["done"] == got["requests"] + unaccepted, got
        assert len(storm.kept) >= 3  # the two songs left alone and at least one id used again
        for name, (_, events) in storm.kept.items():
            alone = solo[name]
            assert (events[-1].frames, events[-1].ended_by) == (alone[-1].frames, alone[-1].ended_by), name
            worst = np.abs(pcm(events) - pcm(alone)).max()
            assert worst < PCM_MAX_ABS, (name, worst)
    finally:
        engine.close()
    if connector is not None:
        assert not segments(connector)
