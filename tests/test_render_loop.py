"""Stage 1's loop (serving/render_loop.py) with a stand-in renderer: windows batch across songs, a song whose
window arrives out of order or whose render fails is failed alone, and its windows still in flight are dropped
until the engine's cancel arrives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from music3serve.acoustic.payloads import WindowPayload
from music3serve.acoustic.windows import Window
from music3serve.errors import Music3Error, NonFiniteAudio
from music3serve.serving import render_loop
from music3serve.serving.render_loop import FAILED_CALLS_BEFORE_STOP, RenderLoop, check_weights_fit


class StandIn:
    """Renders nothing but records the batches; refuses what the real renderer refuses (a window out of order)."""

    max_batch = 8

    def __init__(self, fail_seed: int | str | None = None):
        self.next: dict[str, int] = {}
        self.batches: list[list[tuple[str, int]]] = []
        self.fail_seed = fail_seed

    def next_index(self, song: str) -> int:
        return self.next.get(song, 0)

    def cancel(self, song: str) -> None:
        self.next.pop(song, None)

    def render(self, batch: list[WindowPayload]) -> list:
        self.batches.append([(p.song, p.window.index) for p in batch])
        for p in batch:
            if p.window.index != self.next_index(p.song):
                raise RuntimeError(f"song {p.song!r}: window {p.window.index} arrived out of order")
        if any(p.seed == self.fail_seed or self.fail_seed == "all" for p in batch):
            raise RuntimeError("injected")
        for p in batch:
            self.next[p.song] = p.window.index + 1
        return [SimpleNamespace(song=p.song, window=p.window) for p in batch]


def window(song: str, index: int, seed: int = 0) -> tuple:
    return ("window", WindowPayload(song, seed, Window(index, 100 * index, 200, False), torch.zeros(1), 2))


def run_loop(renderer: StandIn, inboxes: list[list[tuple]]) -> tuple[list, list]:
    chunks, errors = [], []
    feed = iter(inboxes + [[("stop",)]])
    RenderLoop(renderer, lambda block: next(feed), lambda out: chunks.append((out.song, out.window.index)),
               lambda song, message: errors.append((song, message))).run()
    return chunks, errors


def test_a_window_out_of_order_fails_its_song_alone():
    renderer = StandIn()
    chunks, errors = run_loop(renderer, [[window("a", 0), window("a", 2), window("b", 0)], [window("b", 1)]])
    assert [song for song, _ in errors] == ["a"] and "window 2 of song 'a' where window 1 was due" in errors[0][1]
    assert chunks == [("b", 0), ("b", 1)]  # the failed song renders nothing more, its queued window 0 included
    assert all(song == "b" for batch in renderer.batches for song, _ in batch)


def test_a_songs_first_queued_window_must_be_the_renderers_next_one():
    """Window 0 lost: window 1 fails its song before it reaches the renderer (inside a batch the renderer would refuse
    the call, and a window retried alone that fails counts toward stopping stage 1)."""
    renderer = StandIn()
    chunks, errors = run_loop(renderer, [[window("a", 1), window("b", 0)]])
    assert errors == [("a", "stage 1 got window 1 of song 'a' where window 0 was due (an earlier one was lost)")]
    assert chunks == [("b", 0)] and renderer.batches == [[("b", 0)]]


def test_a_failed_song_is_forgotten_by_the_renderer_and_by_the_loop_once_cancelled():
    """The renderer drops a failed song's carry at once; the engine's cancel then clears the loop's record of it, so
    the id can be used again."""
    renderer = StandIn()
    feed = iter([[window("a", 0)], [window("a", 2)], [("cancel", "a")], [("stop",)]])
    seen = []

    def inbox(block: bool) -> list:
        seen.append((dict(renderer.next), set(loop.failed)))
        return next(feed)

    loop = RenderLoop(renderer, inbox, lambda out: None, lambda song, message: None)
    loop.run()
    assert seen == [({}, set()), ({"a": 1}, set()), ({}, {"a"}), ({}, set())]


def test_the_loop_waits_for_work_only_when_none_is_queued():
    """The inbox blocks (waits up to its poll) only with nothing to render: with windows queued it is read without
    waiting, so a render call never starts late."""
    renderer = StandIn()
    renderer.max_batch = 1
    blocks = []
    feed = iter([[window("a", 0), window("b", 0)], [], [], [("stop",)]])
    RenderLoop(renderer, lambda block: blocks.append(block) or next(feed), lambda out: None, lambda s, m: None).run()
    assert blocks == [True, False, True, True]



def test_songs_take_turns_when_more_are_ready_than_a_batch_holds():
    """Round robin: a song served goes to the back of the line, so three songs in batches of two take turns."""
    renderer = StandIn()
    renderer.max_batch = 2
    ready = [window(song, index) for song in "abc" for index in (0, 1)]
    chunks, errors = run_loop(renderer, [ready, [], []])
    assert errors == []
    assert renderer.batches == [[("a", 0), ("b", 0)], [("c", 0), ("a", 1)], [("b", 1), ("c", 1)]]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_weights_that_fill_their_memory_exactly_fit(monkeypatch, device):
    """Stage 1's weights must fit in what it may hold: exactly as many bytes fit, one byte more is refused."""
    modules = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(3))  # buffers count too
    weights = sum(t.numel() * t.element_size() for m in modules for t in [*m.parameters(), *m.buffers()])
    renderer = SimpleNamespace(encoder=modules[0], dit=modules[1], vocoder=modules[2],
                               policy=SimpleNamespace(name="bfloat16"), device=torch.device(device))
    allowed = [weights]
    monkeypatch.setattr(render_loop, "host_memory", lambda: allowed[0])
    monkeypatch.setattr(render_loop, "card_share", lambda dev, share: (allowed[0], f"gpu_memory_utilization {share}"))
    check_weights_fit(renderer, 0.5)
    allowed[0] = weights - 1
    with pytest.raises(Music3Error, match="stage 1 needs 0.0 GiB of bfloat16 weights, more than") as refused:
        check_weights_fit(renderer, 0.5)
    where = "gpu_memory_utilization 0.5" if device == "cuda" else "this machine's 0.0 GiB of memory"
    assert where in str(refused.value)  # the limit of the device the stage runs on

def test_a_failed_render_drops_the_songs_next_windows_until_its_cancel():
    renderer = StandIn(fail_seed=7)
    chunks, errors = run_loop(renderer, [
        [window("a", 0, seed=7)],
        [window("a", 1, seed=7), window("b", 0)],  # in flight before the engine's cancel of "a"
        [("cancel", "a"), window("b", 1)],
    ])
    assert [song for song, _ in errors] == ["a"] and "injected" in errors[0][1]
    assert chunks == [("b", 0), ("b", 1)]


def test_a_window_that_cannot_render_fails_its_song_alone():
    """a's window makes the render raise; b and c were batched with it and failed with it. The call is made again a
    window at a time: a fails, b and c render and go on."""
    renderer = StandIn(fail_seed=7)
    chunks, errors = run_loop(renderer, [[window("a", 0, seed=7), window("b", 0), window("c", 0)], [window("b", 1)]])
    assert [song for song, _ in errors] == ["a"] and "injected" in errors[0][1]
    assert chunks == [("b", 0), ("c", 0), ("b", 1)]
    assert renderer.batches == [[("a", 0), ("b", 0), ("c", 0)], [("a", 0)], [("b", 0)], [("c", 0)], [("b", 1)]]


def test_each_render_call_is_reported_with_its_work():
    """What the worker's heartbeat says while a call runs: its windows times steps / 30, the scale never below 1
    (a few-step song renders faster than the contract's 30 steps); windows of other step counts are other calls."""
    seen = []
    few = ("window", WindowPayload("a", 0, Window(0, 0, 200, False), torch.zeros(1), 2))
    heavy = ("window", WindowPayload("b", 0, Window(0, 0, 200, False), torch.zeros(1), 300))
    feed = iter([[few], [heavy, window("c", 0)], [("stop",)]])
    RenderLoop(StandIn(), lambda block: next(feed), lambda out: None, lambda song, message: None,
               rendering=seen.append).run()
    assert seen == [1.0, None, 1.0, None, 10.0, None]


def test_windows_with_fewer_steps_are_rendered_and_delivered_first():
    """A batch with a 300-step window: the 2-step windows beside it are one call, delivered before the heavy one
    renders (in one call they waited for its whole render)."""
    renderer, order = StandIn(), []
    original = renderer.render
    renderer.render = lambda batch: order.append(("render", [p.song for p in batch])) or original(batch)
    heavy = ("window", WindowPayload("b", 0, Window(0, 0, 200, False), torch.zeros(1), 300))
    feed = iter([[heavy, window("c", 0), window("d", 0)], [("stop",)]])
    RenderLoop(renderer, lambda block: next(feed), lambda out: order.append(("delivered", out.song)),
               lambda song, message: None).run()
    assert order == [("render", ["c", "d"]), ("delivered", "c"), ("delivered", "d"), ("render", ["b"]),
                     ("delivered", "b")]


def test_a_window_after_a_songs_queued_last_window_fails_that_song_at_once():
    """It used to queue, fail at render time as out of order (after the song's Done could have gone out) and blame
    a lost window."""
    renderer = StandIn()
    last = ("window", WindowPayload("a", 0, Window(0, 0, 150, True), torch.zeros(1), 2))
    chunks, errors = run_loop(renderer, [[window("b", 0), last, window("a", 1)], [window("b", 1)]])
    assert errors == [("a", "stage 1 got window 1 of song 'a' after its last window 0")]
    assert chunks == [("b", 0), ("b", 1)]


def test_a_renderer_whose_calls_keep_failing_stops_the_loop():
    """Failed windows fail their songs and the loop goes on; FAILED_CALLS_BEFORE_STOP single-window failures in a row
    are the device's: the loop raises (the engine then reports stage 1 stopped) instead of failing every window."""
    renderer, errors = StandIn(fail_seed="all"), []
    feed = iter([[window(song, 0) for song in "abcd"], [window("e", 0)]])
    loop = RenderLoop(renderer, lambda block: next(feed), lambda out: None, lambda song, message: errors.append(song))
    with pytest.raises(Music3Error, match=f"stage 1 failed {FAILED_CALLS_BEFORE_STOP} windows in a row"):
        loop.run()
    assert errors == list("abcd")[:FAILED_CALLS_BEFORE_STOP]


def test_failures_between_renders_that_succeed_never_stop_the_loop():
    """Every other window fails: each failure is its song's alone, however many there are."""
    renderer = StandIn(fail_seed=7)
    inboxes = [[window(f"bad{i}", 0, seed=7)] + [window(f"good{i}", 0)] for i in range(2 * FAILED_CALLS_BEFORE_STOP)]
    chunks, errors = run_loop(renderer, [[item] for pair in inboxes for item in pair])
    assert [song for song, _ in errors] == [f"bad{i}" for i in range(2 * FAILED_CALLS_BEFORE_STOP)]
    assert chunks == [(f"good{i}", 0) for i in range(2 * FAILED_CALLS_BEFORE_STOP)]


def test_windows_whose_audio_comes_out_non_finite_fail_their_songs_but_never_stop_the_loop():
    """Non-finite audio is the window's content, not the device: the same request retried (a client retries a
    failure; its seed makes the audio the same) failed three times in a row and stopped stage 1 for every client."""

    class NonFinite(StandIn):
        def render(self, batch):
            if any(p.seed == 7 for p in batch):
                raise NonFiniteAudio("window 0 rendered to non-finite audio")
            return super().render(batch)

    retries = [[window(f"retry{i}", 0, seed=7)] for i in range(2 * FAILED_CALLS_BEFORE_STOP)]
    chunks, errors = run_loop(NonFinite(), [*retries, [window("other", 0)]])
    assert [song for song, _ in errors] == [f"retry{i}" for i in range(2 * FAILED_CALLS_BEFORE_STOP)]
    assert chunks == [("other", 0)]
