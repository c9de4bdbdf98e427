"""The shared-memory connector: round trips in one process and across a spawned one, the threshold, timeouts,
and that no shared-memory segment outlives its use (read, close, normal exit, SIGTERM, SIGKILL + cleanup).

Every wait is bounded: gets have timeouts, children are joined with timeouts and killed in teardown."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import music3serve
from music3serve.errors import Music3Error
from music3serve.serving.connectors import (
    ConnectorError,
    ConnectorTimeout,
    LostMessage,
    Message,
    PeerGone,
    SharedMemoryConnector,
    make_connector,
)
from music3serve.serving import shared_memory, shm_segments
from music3serve.serving.deploy_config import connector_extra
from music3serve.serving.deploy_schema import SharedMemoryExtra
from shm_names import segments  # tests/ is on the import path (no package)

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="segment bookkeeping is checked in /dev/shm")

# The seed's connector_of_shared_memory.extra block, verbatim.
SEED_EXTRA = {
    "codec_streaming": True,
    "shm_threshold_bytes": 65536,
    "connector_get_sleep_s": 0.01,
    "connector_get_max_wait_first_chunk": 30000,
    "connector_get_max_wait": 10000,
}
# The same with small waits so that a test never sits for seconds.
EXTRA = {**SEED_EXTRA, "connector_get_max_wait_first_chunk": 2000, "connector_get_max_wait": 200}
THRESHOLD = SEED_EXTRA["shm_threshold_bytes"]
CHILD_WAIT_S = 60.0  # a spawned child imports torch first; generous, but bounded
SPAWN = mp.get_context("spawn")


def payload(seed: int, large: bool) -> dict[str, torch.Tensor | np.ndarray]:
    """Tensors of every kind the stages exchange, plus awkward ones (bf16, int64 extremes, NaN bits, 0-d,
    empty, bool, non-contiguous, numpy)."""
    g = torch.Generator().manual_seed(seed)
    window = torch.randn(200, 4096, generator=g) if large else torch.randn(4, 8, generator=g)
    window.view(-1)[0] = float("nan")
    window.view(-1).view(torch.int32)[1] = 0x7FC01234  # a NaN with a payload: must survive bit for bit
    return {
        "window": window,
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "ids": torch.tensor([-(2**63), 2**63 - 1, 0, 12345678901234], dtype=torch.int64),
        "pcm": np.random.default_rng(seed).standard_normal((2, 33)).astype(np.float32),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "flags": torch.tensor([True, False, True]),
        "strided": torch.arange(24, dtype=torch.int32).view(4, 6).t(),
    }


def raw(t: torch.Tensor | np.ndarray) -> bytes:
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(got: Message, key: str, meta: dict, tensors: dict) -> None:
    assert got.key == key
    assert got.meta == meta
    assert list(got.tensors) == list(tensors)
    for name, want in tensors.items():
        have = got.tensors[name]
        assert type(have) is type(want), name
        assert have.dtype == want.dtype, name
        assert tuple(have.shape) == tuple(want.shape), name
        assert raw(have) == raw(want), f"{name} differs"


META = {"request_id": "r-1", "window": 3, "final": False, "scale": 1.5, "tags": ["a", None], "nested": {"x": [1]}}


def test_settings_from_the_seed_block() -> None:
    """A connector's extra block given on its own is checked by the deploy file's rules (one set of rules)."""
    settings = connector_extra(SEED_EXTRA)
    assert settings.shm_threshold_bytes == 65536 and settings.connector_get_sleep_s == 0.01 and settings.codec_streaming
    assert (settings.first_chunk_timeout_s, settings.timeout_s) == (30.0, 10.0)  # the YAML waits are milliseconds
    assert connector_extra(None) == SharedMemoryExtra() == connector_extra(SEED_EXTRA)
    for bad in ({"connector_get_max_wait": 0}, {"connector_get_sleep_s": "fast"}, {"shm_threshold_bytes": -1},
                {"connector_get_sleep_s": 20.0}):  # a poll longer than the shorter max wait (10 s)
        with pytest.raises(Music3Error, match=f"extra.{next(iter(bad))}"):
            connector_extra(bad)
        with pytest.raises(Music3Error, match=next(iter(bad))):
            SharedMemoryConnector(bad)
    with pytest.raises(Music3Error, match="shm_treshold_bytes"):
        connector_extra({"shm_treshold_bytes": 1})
    with pytest.raises(Music3Error, match="a mapping with the keys"):
        connector_extra(["codec_streaming"])


def test_make_connector() -> None:
    conn = make_connector("SharedMemoryConnector", SEED_EXTRA, channels=("a",))
    try:
        assert isinstance(conn, SharedMemoryConnector)
        assert conn.settings.timeout_s == 10.0 and conn.prefix.startswith(f"m3s_{os.getpid()}_")
    finally:
        conn.close()
    for kind in ("InProcessConnector", "MooncakeConnector", None):
        with pytest.raises(Music3Error, match="allowed: SharedMemoryConnector"):
            make_connector(kind, SEED_EXTRA)


def test_get_times_out_after_the_configured_wait() -> None:
    conn = SharedMemoryConnector(EXTRA, channels=["pcm"])
    try:
        wait = connector_extra(EXTRA).timeout_s  # 200 ms
        started = time.monotonic()
        message = r"no message on channel 'pcm' after waiting \d+\.\d{3} s \(timeout 0\.2 s\)"
        with pytest.raises(ConnectorTimeout, match=message):
            conn.get("pcm", wait)
        assert wait <= time.monotonic() - started < wait + 1.0
        started = time.monotonic()
        with pytest.raises(ConnectorTimeout):
            conn.get("pcm", 0)
        assert time.monotonic() - started < 0.5
    finally:
        conn.close()


def test_close_wakes_a_get_without_timeout() -> None:
    conn = SharedMemoryConnector(EXTRA, channels=["pcm"])
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            conn.get("pcm", None)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(0.1)
    conn.close()
    waiter.join(5.0)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ConnectorError) and "closed" in str(errors[0])


def test_shared_memory_round_trip_in_one_process() -> None:
    conn = SharedMemoryConnector(EXTRA, channels=("to_stage_1", "events"))
    try:
        small, large = payload(1, large=False), payload(2, large=True)
        conn.put("events", ("song", META, small))
        assert segments(conn) == []  # inline
        conn.put("to_stage_1", ("song", META, large))
        assert len(segments(conn, pid=os.getpid())) == 1  # one segment per message
        assert_same(conn.get("events", 1.0), "song", META, small)
        got = conn.get("to_stage_1", 1.0)
        assert segments(conn) == []  # unlinked by the receiver
        assert_same(got, "song", META, large)
        got.tensors["window"].add_(1)  # the copy is the receiver's own memory
        conn.put("events", ("done", {}, {}))
        assert conn.get("events", 1.0) == Message("done", {}, {})
        with pytest.raises(ConnectorError, match="unknown channel 'nope'"):
            conn.put("nope", ("k", {}, {}))
        with pytest.raises(ConnectorError, match="JSON"):
            conn.put("events", ("song", {"bad": torch.zeros(1)}, {}))
    finally:
        conn.close()


def test_a_peer_gone_is_seen_once_its_ends_are_released() -> None:
    """Without this process's own copies of the ends it never uses, the other end's death is an error at once: end
    of file (at a message's start or in its middle) for a reader, a broken pipe for a writer."""
    conn = SharedMemoryConnector(EXTRA, channels=("pcm", "cut", "windows"))
    try:
        conn.put("pcm", ("chunk", META, payload(1, large=False)))
        conn.release("pcm", "writer")  # as if the only sender (a worker) exited after this message
        assert conn.get("pcm", 1.0).key == "chunk"  # what it sent before is still read
        with pytest.raises(PeerGone, match="no sender left"):
            conn.get("pcm", 1.0)
        writer = conn._channel("cut").writer
        os.write(writer.fileno(), (1000).to_bytes(4, "big") + b"half")  # a sender killed mid-message
        conn.release("cut", "writer")
        with pytest.raises(PeerGone, match="no sender left"):
            conn.get("cut", 1.0)
        conn.release("windows", "reader")
        with pytest.raises(PeerGone, match="no reader left"):
            conn.put("windows", ("window", META, payload(2, large=True)))
        assert segments(conn) == []  # the unsent message's segment went with it
        with pytest.raises(ConnectorError, match="end must be"):
            conn.release("pcm", "both")
    finally:
        conn.close()


def test_a_message_whose_segment_was_removed_is_lost_alone() -> None:
    conn = SharedMemoryConnector(EXTRA, channels=("pcm",))
    try:
        conn.put("pcm", ("chunk", {"song": "a#0"}, payload(1, large=True)))
        conn.put("pcm", ("chunk", {"song": "b#1"}, payload(2, large=True)))
        conn.cleanup()  # say systemd's RemoveIPC emptied /dev/shm
        with pytest.raises(LostMessage, match="lost its shared-memory segment") as lost:
            conn.get("pcm", 1.0)
        assert lost.value.meta == {"song": "a#0"}
        conn.put("pcm", ("chunk", {"song": "c#2"}, payload(3, large=False)))
        with pytest.raises(LostMessage):
            conn.get("pcm", 1.0)
        assert conn.get("pcm", 1.0).meta == {"song": "c#2"}  # the channel goes on
    finally:
        conn.close()


def test_threshold_boundary() -> None:
    """At or above shm_threshold_bytes (summed over the message's tensors) travels in shared memory."""
    conn = SharedMemoryConnector(EXTRA, channels=("c",))
    try:
        cases = [
            ({"x": torch.ones(THRESHOLD, dtype=torch.uint8)}, 1),
            ({"x": torch.ones(THRESHOLD - 1, dtype=torch.uint8)}, 0),
            ({"a": torch.ones(THRESHOLD // 8), "b": np.ones(THRESHOLD // 8, np.float32)}, 1),  # 2 x half
            ({"a": torch.ones(THRESHOLD // 2 - 1, dtype=torch.uint8), "b": torch.ones(1, dtype=torch.uint8)}, 0),
        ]
        for tensors, in_shm in cases:
            conn.put("c", ("k", {}, tensors))
            assert len(segments(conn)) == in_shm, {n: t.shape for n, t in tensors.items()}
            assert_same(conn.get("c", 1.0), "k", {}, tensors)
            assert segments(conn) == []
    finally:
        conn.close()


def test_close_unlinks_unread_segments() -> None:
    conn = SharedMemoryConnector(EXTRA, channels=("c",))
    for i in range(3):
        conn.put("c", (f"w{i}", {}, {"x": torch.zeros(200, 4096)}))
    assert len(segments(conn)) == 3
    conn.close()
    assert segments(conn) == []
    conn.close()  # idempotent
    with pytest.raises(ConnectorError, match="closed"):
        conn.put("c", ("k", {}, {}))


def test_get_returns_at_its_timeout_not_after_a_longer_poll_interval() -> None:
    """The deadline cuts the poll interval: a 50 ms get with a 1 s poll gives up after about 50 ms, not 1 s."""
    slow_poll = {**EXTRA, "connector_get_sleep_s": 1.0, "connector_get_max_wait": 2000,
                 "connector_get_max_wait_first_chunk": 2000}
    conn = SharedMemoryConnector(slow_poll, channels=("c",))
    try:
        started = time.monotonic()
        with pytest.raises(ConnectorTimeout):
            conn.get("c", 0.05)
        assert 0.05 <= time.monotonic() - started < 0.9  # under the 1 s poll, with room for a loaded machine
    finally:
        conn.close()


def test_what_the_connector_refuses() -> None:
    """Duplicate channel names, a NaN timeout (not a zero wait), non-finite waits in the settings and numpy arrays of
    Python objects (pointers that mean nothing in another process) are refused with errors that say so."""
    with pytest.raises(ConnectorError, match="distinct"):
        SharedMemoryConnector(EXTRA, channels=("pcm", "pcm"))
    for key in ("connector_get_sleep_s", "connector_get_max_wait", "connector_get_max_wait_first_chunk"):
        for value in (float("inf"), float("nan")):
            with pytest.raises(Music3Error, match=f"extra.{key}: "):
                connector_extra({key: value})
    conn = SharedMemoryConnector(EXTRA, channels=("c",))
    try:
        with pytest.raises(ConnectorError, match="timeout_s must be a number") as info:
            conn.get("c", float("nan"))
        assert not isinstance(info.value, ConnectorTimeout)
        objects = np.array([object(), "x"], dtype=object)
        with pytest.raises(ConnectorError, match="holds Python objects"):
            conn.put("c", ("k", {}, {"x": objects}))
    finally:
        conn.close()


def test_a_put_whose_copy_fails_leaves_no_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message whose tensors cannot be copied into its new segment raises, and the segment is unlinked."""

    def fail(tensors, specs, buf):
        raise RuntimeError("copy failed")

    conn = SharedMemoryConnector(EXTRA, channels=("c",))
    try:
        monkeypatch.setattr(shared_memory, "pack", fail)
        with pytest.raises(RuntimeError, match="copy failed"):
            conn.put("c", ("k", {}, {"x": torch.zeros(THRESHOLD, dtype=torch.uint8)}))
        assert segments(conn) == []
    finally:
        conn.close()


def test_a_message_larger_than_the_free_dev_shm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Filling a segment past /dev/shm's free space would kill the sender with SIGBUS; put refuses it instead."""
    real = os.statvfs

    def tiny(path):
        stats = real(path)
        return SimpleNamespace(f_bavail=1, f_frsize=stats.f_frsize)  # one block free

    conn = SharedMemoryConnector(EXTRA, channels=("c",))
    try:
        monkeypatch.setattr(shm_segments.os, "statvfs", tiny)
        with pytest.raises(ConnectorError, match=r"/dev/shm has 0\.0 MiB free but a message needs 3\.1 MiB; give the "
                           r"container a larger /dev/shm \(docker --shm-size\)"):
            conn.put("c", ("k", {}, {"x": torch.zeros(200, 4096)}))
        assert segments(conn) == []
    finally:
        conn.close()


def test_the_free_space_check_counts_bytes_available_to_the_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm's free space is f_bavail fragments of f_frsize bytes (not f_bfree, which counts reserved blocks, nor
    f_bsize): a message of exactly that size is written, one byte more is refused, saying how much is free."""
    blocks, fragment = 16, 4096  # 64 KiB = THRESHOLD available
    fake = SimpleNamespace(f_bavail=blocks, f_frsize=fragment, f_bfree=1 << 20, f_bsize=1 << 20)
    conn = SharedMemoryConnector(EXTRA, channels=("c",))
    try:
        monkeypatch.setattr(shm_segments.os, "statvfs", lambda path: fake)
        fits = {"x": np.arange(blocks * fragment, dtype=np.uint8)}  # one tensor at offset 0: the segment's size
        conn.put("c", ("fits", {}, fits))
        with pytest.raises(ConnectorError, match=r"/dev/shm has 0\.1 MiB free but a message needs 0\.1 MiB"):
            conn.put("c", ("over", {}, {"x": np.zeros(blocks * fragment + 1, dtype=np.uint8)}))
        monkeypatch.undo()
        assert len(segments(conn)) == 1  # the one that fitted, and nothing of the refused one
        assert_same(conn.get("c", 1.0), "fits", {}, fits)
        with pytest.raises(ConnectorTimeout):
            conn.get("c", 0)  # the refused message never went out
    finally:
        conn.close()
    assert segments(conn) == []


def test_the_registry_of_unread_segments_forgets_the_read_ones_at_its_cap(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A sender's registry of segments it made and that may be unread is pruned once it holds the cap (256 names):
    below the cap nothing is forgotten; at the cap the names whose segment is gone (read elsewhere) are, those
    still present kept; the next cap is twice what was kept, never under 256."""
    assert shm_segments.PRUNE_AT_LEAST == 256  # the numbers below
    registry: dict[str, int] = {}
    monkeypatch.setattr(shm_segments, "_OUTSTANDING", registry)
    monkeypatch.setattr(shm_segments, "_prune_at", shm_segments.PRUNE_AT_LEAST)  # restored after: the test moves it
    monkeypatch.setattr(shm_segments, "SHM_DIR", str(tmp_path))  # a stand-in /dev/shm
    count = itertools.count()

    def add(present: int, gone: int) -> set[str]:
        """Register `present` names whose segment exists and `gone` names whose segment was unlinked."""
        names = set()
        for i in range(present + gone):
            name = f"m3s_test_{next(count)}"
            if i < present:
                (tmp_path / name).touch()
                names.add(name)
            registry[name] = os.getpid()
        return names

    add(0, 255)
    shm_segments._prune_outstanding()
    assert len(registry) == 255  # below the cap: left alone
    add(0, 1)
    shm_segments._prune_outstanding()
    assert registry == {}  # at the cap: every gone name forgotten

    kept = add(150, 106)  # 256 again, 150 still unread
    shm_segments._prune_outstanding()
    assert set(registry) == kept
    add(0, 149)  # 299: under the new cap of 300
    shm_segments._prune_outstanding()
    assert len(registry) == 299
    add(0, 1)
    shm_segments._prune_outstanding()
    assert set(registry) == kept

    for name in kept:  # read by now
        (tmp_path / name).unlink()
    add(0, 150)  # 300: at the cap
    shm_segments._prune_outstanding()
    assert registry == {}
    add(0, 255)  # the cap is back at 256, not at twice nothing
    shm_segments._prune_outstanding()
    assert len(registry) == 255
    add(0, 1)
    shm_segments._prune_outstanding()
    assert registry == {}


def wait_forked(child: int, limit_s: float = 10.0) -> int:
    """Reap a child made by os.fork (killed past `limit_s`) and return its exit code."""
    deadline = time.monotonic() + limit_s
    while True:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            pytest.fail("the forked child did not exit")
        time.sleep(0.005)


def test_a_forked_child_leaves_its_parents_unread_segments_alone() -> None:
    """The registry of unread segments is inherited by a fork; the child's cleanup must skip its parent's."""
    conn = SharedMemoryConnector(EXTRA, channels=("c",))
    try:
        conn.put("c", ("k", {}, {"x": torch.zeros(THRESHOLD, dtype=torch.uint8)}))
        assert len(segments(conn)) == 1
        child = os.fork()
        if child == 0:  # pragma: no cover - the child: what its atexit hook and finalizer run, then out at once
            try:
                shm_segments.unlink_unread()
            finally:
                os._exit(0)
        wait_forked(child)
        assert len(segments(conn)) == 1
        assert conn.get("c", 1.0).tensors["x"].shape == (THRESHOLD,)
    finally:
        conn.close()


def test_close_in_a_worker_unlinks_what_it_sent_and_nobody_read() -> None:
    """close() outside the owner unlinks that process's unread segments (its own, not its parent's), before and
    without any exit hook: the forked child leaves by os._exit, which runs none."""
    conn = SharedMemoryConnector(EXTRA, channels=("c",))
    try:
        conn.put("c", ("parent", {}, {"x": np.zeros(THRESHOLD, dtype=np.uint8)}))
        child = os.fork()
        if child == 0:  # pragma: no cover - the child: numpy only (no torch after a fork), then out at once
            code = 3
            try:
                conn.put("c", ("child", {}, {"x": np.ones(THRESHOLD, dtype=np.uint8)}))
                sent = len(segments(conn, pid=os.getpid()))
                conn.close()  # not the owner: no cleanup by prefix
                code = 0 if (sent, segments(conn, pid=os.getpid())) == (1, []) else 1
            finally:
                os._exit(code)
        assert wait_forked(child) == 0
        assert segments(conn, pid=child) == []
        assert len(segments(conn, pid=os.getpid())) == 1  # the parent's own unread segment is still there
        assert conn.get("c", 1.0).key == "parent"
        with pytest.raises(LostMessage, match="'child'"):
            conn.get("c", 1.0)
    finally:
        conn.close()
    assert segments(conn) == []


def test_sigterm_chained_before_a_python_handler_unlinks_then_calls_it() -> None:
    """Where a Python SIGTERM handler was set first, ours runs before it: unread segments go, then that handler (which
    finds them gone, and may raise to unwind, as the CLI's does, without keeping them)."""
    called: list[int] = []
    conn = SharedMemoryConnector(EXTRA, channels=("c",))
    before = signal.getsignal(signal.SIGTERM)  # after the connector installed its own, if it was the default
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: called.append(len(segments(conn))))
        shm_segments._install_sigterm_handler(os.getpid())
        conn.put("c", ("k", {}, {"x": torch.zeros(THRESHOLD, dtype=torch.uint8)}))
        assert len(segments(conn)) == 1
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while not called and time.monotonic() < deadline:
            time.sleep(0.001)  # Python runs the handler in the main thread, between bytecodes
        assert called == [0]  # the handler ran once, with the segments already unlinked
        assert segments(conn) == []
    finally:
        signal.signal(signal.SIGTERM, before)
        conn.close()


# ---------------------------------------------------------------------------------------- across processes
# Spawn targets live at module level so that the child can import them.


def _echo_child(conn: SharedMemoryConnector) -> None:
    while True:
        msg = conn.get("down", CHILD_WAIT_S)
        if msg.key == "stop":
            break
        conn.put("up", msg)
    conn.close()


def _flood_child(conn: SharedMemoryConnector, count: int, then: str) -> None:
    """Put `count` large messages nobody reads, say so, then wait to be killed or return at once."""
    for i in range(count):
        conn.put("up", (f"w{i}", {"i": i}, {"x": torch.full((200, 4096), float(i))}))
    conn.put("ready", (str(os.getpid()), {}, {}))
    if then == "wait":
        time.sleep(CHILD_WAIT_S)


def _start(target, *args) -> mp.process.BaseProcess:
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _stop(proc: mp.process.BaseProcess) -> None:
    proc.join(10.0)
    if proc.is_alive():
        proc.kill()
        proc.join(10.0)


@pytest.fixture(scope="module")
def echo():
    conn = SharedMemoryConnector(EXTRA, channels=("down", "up"))
    proc = _start(_echo_child, conn)
    try:
        yield conn, proc
    finally:
        try:
            conn.put("down", ("stop", {}, {}))
        finally:
            _stop(proc)
            conn.close()


@pytest.mark.parametrize("large", [False, True], ids=["inline", "shared_memory"])
def test_round_trip_across_a_spawned_process(echo, large: bool) -> None:
    conn, proc = echo
    tensors = payload(3, large)
    conn.put("down", ("song", META, tensors))
    got = conn.get("up", CHILD_WAIT_S)  # there and back: the child received it, then sent it itself
    assert_same(got, "song", META, tensors)
    assert segments(conn) == []  # both segments (there, back) unlinked by their readers
    with pytest.raises(ConnectorError, match="already sent to another process"):
        conn.open_channel("late")


def test_sigkilled_child_segments_removed_by_cleanup() -> None:
    conn = SharedMemoryConnector(EXTRA, channels=("up", "ready"))
    proc = _start(_flood_child, conn, 3, "wait")
    try:
        assert conn.get("ready", CHILD_WAIT_S).key == str(proc.pid)
        assert len(segments(conn, pid=proc.pid)) == 3
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10.0)
        assert proc.exitcode == -signal.SIGKILL
        assert len(segments(conn, pid=proc.pid)) == 3  # nobody could clean up in the child
        assert conn.cleanup() == 3
        assert segments(conn) == []
        with pytest.raises(ConnectorError, match=r"message 'w0' on channel 'up' lost its shared-memory segment"):
            conn.get("up", 1.0)  # what the dead worker queued reports itself, then the channel drains
    finally:
        _stop(proc)
        conn.close()
    assert segments(conn) == []


def test_close_in_the_owner_removes_a_killed_childs_segments() -> None:
    conn = SharedMemoryConnector(EXTRA, channels=("up", "ready"))
    proc = _start(_flood_child, conn, 2, "wait")
    try:
        conn.get("ready", CHILD_WAIT_S)
        proc.kill()
        proc.join(10.0)
        assert len(segments(conn)) == 2
    finally:
        _stop(proc)
        conn.close()
    assert segments(conn) == []


def test_child_exit_and_sigterm_unlink_unread_segments() -> None:
    """A worker that returns (atexit / finalizers) or gets SIGTERM removes what it sent and nobody read."""
    conn = SharedMemoryConnector(EXTRA, channels=("up", "ready"))
    returns = _start(_flood_child, conn, 2, "return")
    waits = _start(_flood_child, conn, 2, "wait")
    try:
        ready = {conn.get("ready", CHILD_WAIT_S).key, conn.get("ready", CHILD_WAIT_S).key}
        assert ready == {str(returns.pid), str(waits.pid)}
        assert len(segments(conn, pid=waits.pid)) == 2
        waits.terminate()  # SIGTERM
        waits.join(10.0)
        returns.join(10.0)
        assert waits.exitcode == -signal.SIGTERM  # still dies of the signal
        assert returns.exitcode == 0
        assert segments(conn) == []
    finally:
        _stop(returns)
        _stop(waits)
        conn.close()


def _put_and_return(conn: SharedMemoryConnector) -> None:
    """A fork-started worker: put one large message nobody reads (numpy only: no torch after a fork), return."""
    conn.put("c", ("child", {}, {"x": np.ones(THRESHOLD, dtype=np.uint8)}))


def test_a_fork_started_child_unlinks_its_own_unread_segments_at_exit_and_not_its_parents() -> None:
    """multiprocessing empties the finalizer registry of a fork-started child and it leaves by os._exit (no atexit):
    its first segment installs a finalizer of its own, which unlinks what it sent unread and skips the parent's
    segments it inherited in the registry."""
    conn = SharedMemoryConnector(EXTRA, channels=("c",))
    proc = None
    try:
        conn.put("c", ("parent", {}, {"x": np.zeros(THRESHOLD, dtype=np.uint8)}))
        proc = mp.get_context("fork").Process(target=_put_and_return, args=(conn,), daemon=True)
        proc.start()
        proc.join(10.0)
        assert proc.exitcode == 0
        assert segments(conn, pid=proc.pid) == []
        assert len(segments(conn, pid=os.getpid())) == 1
        assert conn.get("c", 1.0).key == "parent"
        with pytest.raises(LostMessage, match="'child'"):  # dropped when its sender exited
            conn.get("c", 1.0)
    finally:
        if proc is not None:
            _stop(proc)
        conn.close()
    assert segments(conn) == []


def test_no_resource_tracker_warnings_and_nothing_left(tmp_path: Path) -> None:
    """A whole program: owner and spawned worker exchange a large message both ways, then exit. The resource
    tracker (which prints to the program's stderr when it shuts down) must have nothing to say."""
    script = tmp_path / "exchange.py"
    script.write_text(
        textwrap.dedent(
            """
            import multiprocessing as mp
            import torch
            from music3serve.serving.connectors import SharedMemoryConnector
            from music3serve.serving.shm_segments import list_segments

            def child(conn):
                conn.put("up", conn.get("down", 60))
                conn.get("down", 60)  # wait until the owner has read the reply
                conn.close()

            if __name__ == "__main__":
                conn = SharedMemoryConnector(None, channels=("down", "up"))
                proc = mp.get_context("spawn").Process(target=child, args=(conn,))
                proc.start()
                x = torch.randn(200, 4096)
                conn.put("down", ("k", {"n": 1}, {"x": x}))
                back = conn.get("up", 60)
                assert torch.equal(back.tensors["x"], x)
                conn.put("down", ("ack", {}, {}))
                proc.join(60)
                assert proc.exitcode == 0, proc.exitcode
                print("LEFT", list_segments(conn.prefix), conn.prefix)
                conn.close()
            """
        )
    )
    src = str(Path(music3serve.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "LEFT [] m3s_" in done.stdout
    prefix = done.stdout.split()[-1]
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
    for word in ("resource_tracker", "leaked", "Traceback", "Warning", "KeyError"):
        assert word not in done.stderr, done.stderr
