"""Stage 0's thread (serving/talker_loop.py) driven with fakes: a talker whose steps return scripted events, a stage 1
that records what it is sent, and the engine's side (Callers) as a set of songs still live, with what it was told."""

from __future__ import annotations

import math
import threading
from typing import Callable

import pytest
import torch

from music3serve.acoustic.payloads import WindowPayload
from music3serve.acoustic.windows import Window
from music3serve.errors import InputError, Music3Error
from music3serve.serving.heartbeat import StageWatch
from music3serve.serving.metrics import EngineMetrics
from music3serve.serving.render_loop import FAILED_CALLS_BEFORE_STOP
from music3serve.serving.talker_loop import Callers, TalkerLoop
from music3serve.talker.events import Event, SongFinished, WindowReady


class ScriptedTalker:
    """A talker whose step k returns script[k]() (the events of that step); the last step sets `stop`, which ends
    the loop."""

    stream = None
    frames_written = 0

    def __init__(self, script: list[Callable[[], list[Event]]], stop: threading.Event):
        self.script, self.stop = list(script), stop
        self.songs: dict[str, int] = {}
        self.active: list = []
        self.cancelled: list[str] = []  # by cancel (the loop's own end cancels all, apart)

    @property
    def busy(self) -> bool:
        return bool(self.script)

    def submit(self, song: str, cond: list[int], uncond: list[int], seed: int, requested: int) -> int:
        self.songs[song] = requested
        return requested

    def step(self) -> list[Event]:
        events = self.script.pop(0)()
        if not self.script:
            self.stop.set()
        return events

    def cancel(self, song: str) -> bool:
        self.cancelled.append(song)
        return self.songs.pop(song, None) is not None

    def cancel_all(self) -> None:
        self.songs.clear()


class RecordingStage1:
    """Stage 1 that records the windows sent to it; `on_send(payload)` runs inside send (a stage 1 may fail a song
    there)."""

    def __init__(self, on_send: Callable[[WindowPayload], None] = lambda payload: None):
        self.sent: list[tuple[str, int]] = []
        self.on_send = on_send

    def send(self, payload: WindowPayload, ready: torch.cuda.Event | None) -> None:
        self.sent.append((payload.song, payload.window.index))
        self.on_send(payload)

    def cancel(self, key: str) -> None:
        pass


class LiveSongs:
    """The engine's side: songs are live from their submission (the engine holds a song before it submits it) until
    they are refused or fail (or `end` is called, as another thread of the engine would, say a stage that died
    failing every song, or a caller's cancel); `told` lists what it was told but `live`."""

    def __init__(self):
        self.live: set[str] = set()
        self.told: list[tuple] = []

    def end(self, song: str) -> None:
        self.live.discard(song)

    def tell(self, *what) -> None:
        self.told.append(what)
        if what[0] in ("refused", "fail"):
            self.end(what[1])

    def callers(self) -> Callers:
        return Callers(
            live=lambda song: song in self.live,
            accepted=lambda *args: self.tell("accepted", *args),
            refused=lambda *args: self.tell("refused", *args),
            finished=lambda event: self.tell("finished", event.song),
            fail=lambda *args: self.tell("fail", *args),
        )


def window(index: int, last: bool = False) -> WindowReady:
    """Window `index` of song "a" (100 frames apart, 200 long), as the talker emits it."""
    return WindowReady("a", 7, Window(index, 100 * index, 200, last), torch.zeros(200, 4))


def finished() -> SongFinished:
    return SongFinished("a", 300, "budget", torch.zeros(300, 8, dtype=torch.int64))


def run_loop(script: list[Callable[[], list[Event]]], stage1: RecordingStage1, songs: LiveSongs,
             talker: type[ScriptedTalker] = ScriptedTalker, cancelled_first: bool = False) -> TalkerLoop:
    """Submit song "a" (seed 7, 300 frames, a 2-token prompt, 2 Euler steps), then run the talker loop
    (async_chunk false: windows held until the song's last frame) through the script's steps, on this thread.
    cancelled_first: its caller cancelled it between the engine's hold and its submit (the cancel comes first)."""
    stop = threading.Event()
    loop = TalkerLoop(talker(script, stop), songs.callers(), stage1, StageWatch(math.inf, "talker call"),
                      EngineMetrics(lambda: 0, lambda: 0, lambda: 0), stop, async_chunk=False)
    if cancelled_first:
        loop.cancel("a")
    else:
        songs.live.add("a")
    loop.submit("a", [1, 2], [1, 2], 7, 300, 2)
    loop.run()
    return loop


SENT = {  # how song "a" fares -> the windows stage 1 gets
    "live to its end": [("a", 0), ("a", 1), ("a", 2)],
    "ended between its steps": [],
    "failed by the send of its first window": [("a", 0)],
}


@pytest.mark.parametrize("how", list(SENT))
def test_without_async_chunk_no_window_of_a_song_that_ended_is_sent_to_stage_1(how: str) -> None:
    """A song's windows are held until its SongFinished, then sent on in order. If the song has ended since they
    were held, its cancel not yet taken by the loop (say a dying stage failed every song, or its caller's cancel is
    on its way), or the send of one of them fails it (a stage 1 that renders inside send), the rest are not sent to
    stage 1, which would render them for nobody."""
    songs = LiveSongs()
    failing = how == "failed by the send of its first window"
    stage1 = RecordingStage1(on_send=lambda payload: songs.end(payload.song) if failing else None)
    ending = (lambda: songs.end("a")) if how == "ended between its steps" else (lambda: None)
    script = [lambda: [window(0)], lambda: (ending(), [window(1)])[1], lambda: [window(2, last=True), finished()]]
    loop = run_loop(script, stage1, songs)
    assert stage1.sent == SENT[how]
    assert not loop.held_windows and not loop.steps


def test_a_song_whose_caller_is_gone_when_it_is_taken_is_not_decoded() -> None:
    """A cancel from another thread between the engine's hold and its submit reaches the loop before the song (and
    finds nothing to cancel): the song, taken next, is skipped, not decoded for nobody."""
    songs = LiveSongs()
    loop = run_loop([lambda: []], RecordingStage1(), songs, cancelled_first=True)
    assert loop.talker.cancelled == ["a"]  # the cancel, taken first
    assert not loop.talker.songs and not songs.told and not loop.steps
    assert loop.metrics.requests._value.get() == 0


class RefusingTalker(ScriptedTalker):
    def submit(self, song: str, cond: list[int], uncond: list[int], seed: int, requested: int) -> int:
        raise InputError("the prompt leaves no room")


class BrokenTalker(ScriptedTalker):
    """Queues the song, then fails (say a device error while copying its prompt)."""

    def submit(self, song: str, cond: list[int], uncond: list[int], seed: int, requested: int) -> int:
        super().submit(song, cond, uncond, seed, requested)
        raise RuntimeError("device lost")


def test_a_song_taken_is_accepted_with_its_seed_budget_and_prompt_length() -> None:
    songs, stage1 = LiveSongs(), RecordingStage1()
    loop = run_loop([lambda: []], stage1, songs)
    assert songs.told == [("accepted", "a", 7, 300, 2)]
    assert loop.metrics.requests._value.get() == 1
    assert loop.steps == {"a": 2}  # the Euler steps its windows' payloads will carry


def test_a_song_the_talker_refuses_is_told_refused_and_counted_as_an_invalid_request() -> None:
    songs = LiveSongs()
    loop = run_loop([lambda: []], RecordingStage1(), songs, talker=RefusingTalker)
    assert songs.told == [("refused", "a", "the prompt leaves no room")]
    assert loop.metrics.requests._value.get() == 0
    assert loop.metrics.refusals.labels("invalid")._value.get() == 1
    assert not loop.steps


def test_a_song_the_talker_fails_to_take_fails_and_what_was_queued_of_it_is_cancelled() -> None:
    songs = LiveSongs()
    loop = run_loop([lambda: []], RecordingStage1(), songs, talker=BrokenTalker)
    assert songs.told == [("fail", "a", "stage 0 could not take the song: device lost")]
    assert loop.talker.cancelled == ["a"]
    assert loop.metrics.requests._value.get() == 0 and loop.metrics.refusals.labels("invalid")._value.get() == 0


def test_a_failed_step_fails_its_songs_and_the_loop_stops_after_failing_calls_in_a_row() -> None:
    """Each failed step fails the songs it held (here the queue, as no song is decoding) and the loop goes on; a
    step that succeeds resets the count; FAILED_CALLS_BEFORE_STOP failures in a row stop the loop, at the last."""
    songs, steps = LiveSongs(), []

    def step(ok: bool) -> Callable[[], list[Event]]:
        def run() -> list[Event]:
            steps.append(ok)
            if not ok:
                raise RuntimeError("illegal memory access")
            return []
        return run

    fails = [step(False)] * (FAILED_CALLS_BEFORE_STOP - 1)
    script = [*fails, step(True), *fails, step(False), step(True)]
    with pytest.raises(Music3Error, match=f"failed {FAILED_CALLS_BEFORE_STOP} steps in a row"):
        run_loop(script, RecordingStage1(), songs)
    assert len(steps) == 2 * FAILED_CALLS_BEFORE_STOP  # stopped at the failure that made it in a row, not before
    assert songs.told == [("accepted", "a", 7, 300, 2), ("fail", "a", "stage 0 failed: illegal memory access")]
