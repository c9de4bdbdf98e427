"""The engine's parts built alone, without models or threads: the songs held for callers (HeldSongs) and the guard
of the stage threads (StageGuard)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from music3serve.errors import EngineBusy, InputError, Music3Error
from music3serve.serving.events import Failed
from music3serve.serving.held_songs import HeldSongs, SongClient
from music3serve.serving.metrics import EngineMetrics
from music3serve.serving.stage_guard import StageGuard


def held_songs(max_songs: int = 2, max_unread_bytes: int = 100) -> tuple[HeldSongs, list[str]]:
    """HeldSongs with its own metrics, and the keys it reported as gone with their caller's loop."""
    gone: list[str] = []
    held = HeldSongs(max_songs, max_unread_bytes, EngineMetrics(lambda: 0, lambda: 0, lambda: 0), gone.append)
    return held, gone


def client(song: str, loop: asyncio.AbstractEventLoop, unread_bytes: int = 10) -> SongClient:
    return SongClient(song, loop, asyncio.Queue(), 0.0, unread_bytes=unread_bytes)


def test_held_songs_claim_room_and_ids_and_end_each_song_once():
    loop = asyncio.new_event_loop()
    try:
        held, _ = held_songs()
        first = client("a", loop, unread_bytes=60)
        key = held.new_key("a")
        held.hold(key, first)
        assert held.key_of("a") == key and held.client(key) is first and len(held) == 1 and held.live(key)
        with pytest.raises(InputError, match="'a' is taken"):
            held.hold(held.new_key("a"), client("a", loop))
        with pytest.raises(EngineBusy, match="not read"):  # 60 + 50 bytes pass the 100 held for callers
            held.hold(held.new_key("b"), client("b", loop, unread_bytes=50))
        held.hold(held.new_key("b"), client("b", loop, unread_bytes=40))
        with pytest.raises(EngineBusy, match="holds 2 songs"):
            held.hold(held.new_key("c"), client("c", loop, unread_bytes=0))
        assert held.unread_audio() == 100
        held.hold_read_audio(5)
        assert held.unread_audio() == 105 and held.read_audio_held == 5
        cancels = held.metrics.registry.get_sample_value("music3_cancels_total")
        assert held.count_cancel(key) and not held.count_cancel(key) and held.end(key) is None
        assert held.metrics.registry.get_sample_value("music3_cancels_total") == cancels + 1
        assert not held.live(key)
        assert held.forget(key) and not held.forget(key)
        assert held.key_of("a") is None and held.key_of("b") is not None and len(held) == 1
    finally:
        loop.close()


def test_held_songs_emit_to_the_callers_loop_and_forget_a_song_whose_loop_is_gone():
    loop = asyncio.new_event_loop()
    held, gone = held_songs()
    listening, key = client("a", loop), held.new_key("a")
    held.hold(key, listening)
    held.emit(key, Failed, "cancelled")
    loop.run_until_complete(asyncio.sleep(0))  # the queued delivery runs on the caller's loop
    assert listening.events.get_nowait() == Failed("a", "cancelled")
    loop.close()
    held.emit(key, Failed, "cancelled")
    assert gone == [key] and held.client(key) is None and held.key_of("a") is None


def guard(fail_all, watches=None) -> StageGuard:
    stage1 = SimpleNamespace(loss=None, paused=lambda: None, check=lambda: None)
    return StageGuard(torch.device("cpu"), watches or {}, stage1, threading.Event(), fail_all)


def test_a_dying_stage_loop_stops_serving_with_the_first_reason():
    reasons: list[str] = []
    stage_guard = guard(reasons.append)

    def dies() -> None:
        raise Music3Error("the worker is gone")

    def dies_later() -> None:
        raise RuntimeError("too late to be the reason")

    stage_guard.guarded(dies)
    stage_guard.guarded(dies_later)
    first = f"engine stage stopped ({threading.current_thread().name}): the worker is gone"
    assert stage_guard.broken == first and reasons == [first, first]


def test_the_watch_stops_serving_when_a_stage_call_hangs():
    reasons: list[str] = []
    hung = SimpleNamespace(hung=lambda: "has run one call for 9 s", paused=lambda seconds: None)
    stage_guard = guard(reasons.append, {"stage 0": hung})
    stage_guard.watch_loop()  # returns once it has found the hang
    assert stage_guard.hung_stage == "stage 0"
    assert reasons == ["stage 0 has run one call for 9 s and counts as hung; restart the engine's process"]
