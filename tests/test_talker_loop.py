"""Stage 0's thread (serving/talker_loop.py) driven with fakes: a talker whose steps return scripted events, a stage 1
that records what it is sent, and the engine's side (Songs) as a set of songs still live."""

from __future__ import annotations

import math
import threading
from typing import Callable

import pytest
import torch

from music3serve.acoustic.renderer import WindowPayload
from music3serve.acoustic.windows import Window
from music3serve.serving.heartbeat import StageWatch
from music3serve.serving.metrics import EngineMetrics
from music3serve.serving.talker_loop import Songs, TalkerLoop
from music3serve.talker.engine import Event, SongFinished, WindowReady


class ScriptedTalker:
    """A talker whose step k returns script[k]() (the events of that step); the last step sets `stop`, which ends
    the loop."""

    stream = None
    frames_written = 0

    def __init__(self, script: list[Callable[[], list[Event]]], stop: threading.Event):
        self.script, self.stop = list(script), stop
        self.songs: dict[str, int] = {}
        self.active: list = []

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
    """The engine's side: songs are live from their acceptance until they fail (or `end` is called, as another
    thread of the engine would, say a stage that died failing every song)."""

    def __init__(self):
        self.live: set[str] = set()
        self.failed: list[str] = []

    def end(self, song: str) -> None:
        self.live.discard(song)

    def songs(self) -> Songs:
        return Songs(
            live=lambda song: song in self.live,
            accepted=lambda song, seed, budget, prompt_tokens: self.live.add(song),
            refused=lambda song, message: self.end(song),
            finished=lambda event: None,
            fail=lambda song, message: (self.failed.append(song), self.end(song)),
        )


def window(index: int, last: bool = False) -> WindowReady:
    """Window `index` of song "a" (100 frames apart, 200 long), as the talker emits it."""
    return WindowReady("a", 7, Window(index, 100 * index, 200, last), torch.zeros(200, 4))


def finished() -> SongFinished:
    return SongFinished("a", 300, "budget", torch.zeros(300, 8, dtype=torch.int64))


def run_loop(script: list[Callable[[], list[Event]]], stage1: RecordingStage1, songs: LiveSongs) -> TalkerLoop:
    """Submit song "a", then run the talker loop (async_chunk false: windows held until the song's last frame)
    through the script's steps, on this thread."""
    stop = threading.Event()
    loop = TalkerLoop(ScriptedTalker(script, stop), songs.songs(), stage1, StageWatch(math.inf, "talker call"),
                      EngineMetrics(lambda: 0, lambda: 0), stop, async_chunk=False)
    loop.control.put(("submit", "a", [1, 2], [1, 2], 7, 300, 2))
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
    assert not loop.held and not loop.steps
