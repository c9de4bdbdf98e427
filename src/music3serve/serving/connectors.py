"""Connectors: how messages travel between stages and back to the API server.

A message is ``(key, meta, tensors)``: ``key`` names the request it belongs to, ``meta`` is a dict of JSON-able
values, ``tensors`` a dict of named ``torch.Tensor`` or ``numpy.ndarray``. In practice: window payloads
[200, 4096] float32 (3.3 MB) from stage 0 to stage 1, stereo PCM chunks [2, N] float32 from stage 1 back to the
API server, and small events with no tensors at all.

Two implementations of the :class:`Connector` protocol:

- :class:`InProcessConnector`: one ``queue.Queue`` per channel, for stages that share a process (threads);
  the tensors are passed by reference, nothing is copied.
- :class:`SharedMemoryConnector`: for stages in different processes (multiprocessing, spawn context). A message
  whose tensors total fewer than ``shm_threshold_bytes`` travels inline through the channel's pipe; at or above
  the threshold its tensors are copied into one ``multiprocessing.shared_memory`` segment and the pipe carries
  only the segment's name and the tensors' dtypes, shapes and offsets. The receiver maps the segment, copies the
  tensors out into memory of its own, then closes and unlinks the segment.

Segment lifetime (the part that must not leak: /dev/shm is RAM, and small in containers):

- Every segment is named ``<prefix><creator pid>_<random>``, with a per-connector prefix
  ``m3s_<owner pid>_<uuid8>_``; so a segment says which connector and which process made it.
- The receiver unlinks a segment as soon as it has copied the tensors out.
- Each process keeps a registry of the segments it created and that may not have been read yet. ``close()``
  unlinks this process's outstanding segments; in the process that built the connector (the owner) it also
  unlinks every segment with the connector's prefix, since the connector is over.
- At interpreter exit (atexit, and multiprocessing's finalizers, which also run in forked children) and on
  SIGTERM (a handler installed when the SIGTERM disposition is still the default, or chained before a Python
  handler) a process unlinks the segments it created that were not read yet. Messages put and never read are
  dropped when their sender exits: a sender that wants its last messages delivered waits for the reader.
- SIGKILL cannot be caught, so the owner (the orchestrator) calls ``cleanup(pid)`` when it sees a worker die:
  that unlinks every segment the dead process created (found by prefix in /dev/shm). ``cleanup()`` without a
  pid removes every segment of the connector. Messages of the dead worker still queued in a pipe then raise
  :class:`ConnectorError` naming their key when read.
- Python's ``resource_tracker`` is kept out of it on purpose: it would unlink segments of a process that exits
  (warning about "leaked" objects that another process still has to read) and, on Python < 3.13, registers a
  segment again in every process that attaches to it, which ends in double-unlink warnings. Here the creator
  and the receiver unregister right after creating or attaching (``track=False`` on 3.13+), and unlinking is done
  by name without the tracker.

Linux is the target: the prefix scan of ``cleanup`` reads /dev/shm; elsewhere it only knows the segments its
own process created.
"""

from __future__ import annotations

import atexit
import json
import math
import multiprocessing as mp
import os
import pickle
import queue
import secrets
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing import util as mp_util
from multiprocessing.shared_memory import SharedMemory
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import Music3Error

try:  # POSIX: unlink a segment by name without mapping it or involving the resource tracker
    import _posixshmem
except ImportError:  # pragma: no cover - Windows, where a segment dies with its last handle
    _posixshmem = None

SHM_DIR = "/dev/shm"
_ALIGN = 64  # byte alignment of each tensor inside a payload buffer
_TRACK_KWARG = sys.version_info >= (3, 13)  # SharedMemory(track=False) exists from 3.13
_F_SETPIPE_SZ = 1031  # Linux fcntl: grow a pipe's buffer
_PIPE_BYTES = 1 << 20  # ask for 1 MiB of pipe buffer (the unprivileged maximum by default)


class ConnectorError(Music3Error):
    """A message could not be sent or received (closed connector, unknown channel, lost segment, ...)."""


class ConnectorTimeout(ConnectorError):
    """``get`` waited as long as it was allowed to and no message arrived on the channel."""


# --------------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class ConnectorSettings:
    """The ``extra`` block of a connector in the deploy YAML, with the waits converted to seconds."""

    codec_streaming: bool = True
    shm_threshold_bytes: int = 65536
    get_sleep_s: float = 0.01
    first_chunk_timeout_s: float = 30.0
    timeout_s: float = 10.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | ConnectorSettings | None) -> ConnectorSettings:
        """Read the YAML keys (waits in MILLISECONDS there); a missing key keeps its default."""
        if extra is None:
            return cls()
        if isinstance(extra, ConnectorSettings):
            return extra
        if not isinstance(extra, Mapping):
            raise Music3Error(f"connector extra settings must be a mapping, got {type(extra).__name__}")
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise Music3Error(f"unknown connector setting(s) {unknown}; known: {sorted(_EXTRA_KEYS)}")
        codec_streaming = extra.get("codec_streaming", True)
        if not isinstance(codec_streaming, bool):
            raise Music3Error(f"connector setting codec_streaming must be true or false, got {codec_streaming!r}")
        threshold = extra.get("shm_threshold_bytes", 65536)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise Music3Error(f"connector setting shm_threshold_bytes must be an integer >= 0, got {threshold!r}")
        return cls(
            codec_streaming=codec_streaming,
            shm_threshold_bytes=threshold,
            get_sleep_s=_positive(extra, "connector_get_sleep_s", 0.01),
            first_chunk_timeout_s=_positive(extra, "connector_get_max_wait_first_chunk", 30000) / 1000.0,
            timeout_s=_positive(extra, "connector_get_max_wait", 10000) / 1000.0,
        )


_EXTRA_KEYS = (
    "codec_streaming",
    "shm_threshold_bytes",
    "connector_get_sleep_s",
    "connector_get_max_wait_first_chunk",
    "connector_get_max_wait",
)


def _positive(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise Music3Error(f"connector setting {key} must be a positive number, got {value!r}")
    return float(value)


def timeouts(extra: Mapping[str, Any] | ConnectorSettings | None) -> tuple[float, float]:
    """``(first_chunk_timeout_s, timeout_s)`` from a connector's ``extra`` block (given there in milliseconds).

    The first applies to a request's first chunk (it also covers stage-0 prefill), the second to later ones."""
    settings = ConnectorSettings.from_extra(extra)
    return settings.first_chunk_timeout_s, settings.timeout_s


# ---------------------------------------------------------------------------------------------------- messages


class Message(NamedTuple):
    key: str
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor | np.ndarray]

    @property
    def nbytes(self) -> int:
        """Total bytes of the tensors (what the shared-memory threshold is compared with)."""
        return sum(_nbytes(t) for t in self.tensors.values())


def _nbytes(t: torch.Tensor | np.ndarray) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else int(t.nbytes)


def _check_message(message: Any) -> Message:
    """The same checks for every connector, so that what works in one process also works across processes."""
    if not isinstance(message, tuple) or len(message) != 3:
        raise ConnectorError(f"a message is (key, meta, tensors), got {type(message).__name__}")
    key, meta, tensors = message
    if not isinstance(key, str):
        raise ConnectorError(f"message key must be a str, got {type(key).__name__}")
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise ConnectorError(f"meta of message {key!r} must be a dict with str keys")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise ConnectorError(f"meta of message {key!r} must hold JSON-able values only: {exc}") from None
    if not isinstance(tensors, dict):
        raise ConnectorError(f"tensors of message {key!r} must be a dict, got {type(tensors).__name__}")
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise ConnectorError(f"tensor names of message {key!r} must be str, got {name!r}")
        if isinstance(t, torch.Tensor):
            if t.layout != torch.strided or t.is_meta or t.is_quantized:
                raise ConnectorError(f"tensor {name!r} of message {key!r} must be a dense tensor with data")
        elif isinstance(t, np.ndarray):
            if t.dtype.hasobject:
                raise ConnectorError(f"array {name!r} of message {key!r} holds Python objects")
        else:
            raise ConnectorError(
                f"tensor {name!r} of message {key!r} must be a torch.Tensor or numpy.ndarray, got {type(t).__name__}"
            )
    return Message(key, meta, tensors)


class _Spec(NamedTuple):
    name: str
    kind: str  # "torch" or "numpy"
    dtype: Any  # torch.dtype or numpy.dtype (both pickle)
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _layout(tensors: Mapping[str, torch.Tensor | np.ndarray]) -> tuple[list[_Spec], int]:
    """Where each tensor goes in one payload buffer (64-byte aligned), and the buffer's size."""
    specs, end = [], 0
    for name, t in tensors.items():
        offset = -(-end // _ALIGN) * _ALIGN
        nbytes = _nbytes(t)
        kind = "torch" if isinstance(t, torch.Tensor) else "numpy"
        specs.append(_Spec(name, kind, t.dtype, tuple(t.shape), offset, nbytes))
        end = offset + nbytes
    return specs, end


def _pack(tensors: Mapping[str, torch.Tensor | np.ndarray], specs: list[_Spec], buf: Any) -> None:
    """Copy the tensors into a writable buffer at the offsets of ``specs`` (one copy; CUDA tensors included)."""
    for spec in specs:
        if spec.nbytes == 0:
            continue
        src = tensors[spec.name]
        if spec.kind == "torch":
            count = spec.nbytes // src.element_size()
            dst = torch.frombuffer(buf, dtype=spec.dtype, count=count, offset=spec.offset)
            dst.view(spec.shape).copy_(src.detach())
            del dst
        else:
            np.ndarray(spec.shape, spec.dtype, buffer=buf, offset=spec.offset)[...] = src


def _unpack(specs: list[_Spec], buf: Any, copy: bool) -> dict[str, torch.Tensor | np.ndarray]:
    """Tensors from a payload buffer: views on it (``copy=False``, the buffer must be writable and private) or
    copies that do not hold on to it (``copy=True``, for shared memory that is unlinked right after)."""
    out: dict[str, torch.Tensor | np.ndarray] = {}
    for spec in specs:
        if spec.kind == "torch":
            if spec.nbytes == 0:
                out[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)
                continue
            count = spec.nbytes // spec.dtype.itemsize
            view = torch.frombuffer(buf, dtype=spec.dtype, count=count, offset=spec.offset).view(spec.shape)
            if copy:
                tensor = torch.empty(spec.shape, dtype=spec.dtype)
                tensor.copy_(view)
                out[spec.name] = tensor
            else:
                out[spec.name] = view
            del view
        else:
            if spec.nbytes == 0:
                out[spec.name] = np.empty(spec.shape, dtype=spec.dtype)
                continue
            view = np.ndarray(spec.shape, spec.dtype, buffer=buf, offset=spec.offset)
            out[spec.name] = view.copy() if copy else view
            del view
    return out


# ----------------------------------------------------------------------------------------------------- protocol


@runtime_checkable
class Connector(Protocol):
    """What a stage or the API server uses to hand messages over; every channel is a FIFO."""

    def put(self, channel: str, message: Message | tuple[str, dict, dict]) -> None: ...

    def get(self, channel: str, timeout_s: float | None) -> Message:
        """The next message on ``channel``; ``ConnectorTimeout`` after ``timeout_s`` (None: no limit, 0: no wait)."""
        ...

    def close(self) -> None: ...

    def cleanup(self, pid: int | None = None) -> int:
        """Remove what a dead process left behind; returns how many shared-memory segments were unlinked."""
        ...


def _deadline(timeout_s: float | None) -> float | None:
    if timeout_s is None:
        return None
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or math.isnan(timeout_s):
        raise ConnectorError(f"timeout_s must be a number of seconds or None, got {timeout_s!r}")
    return time.monotonic() + max(0.0, float(timeout_s))


def _step(deadline: float | None, sleep_s: float) -> float:
    """How long the next wait may last: the poll interval, cut at the deadline."""
    return sleep_s if deadline is None else max(0.0, min(sleep_s, deadline - time.monotonic()))


def _timeout_error(channel: str, timeout_s: float | None, started: float) -> ConnectorTimeout:
    waited = time.monotonic() - started
    return ConnectorTimeout(
        f"no message on channel {channel!r} after waiting {waited:.3f} s (timeout {timeout_s} s); "
        "the sending stage is slow, stuck or gone"
    )


# ------------------------------------------------------------------------------------------------- in process


class InProcessConnector:
    """Channels as ``queue.Queue`` in one process; messages (and their tensors) are passed by reference.

    ``channels``: the allowed channel names, or None to create a channel on first use."""

    def __init__(
        self, extra: Mapping[str, Any] | ConnectorSettings | None = None, *, channels: Iterable[str] | None = None
    ):
        self.settings = ConnectorSettings.from_extra(extra)
        self._declared = None if channels is None else _channel_names(channels)
        self._queues: dict[str, queue.Queue] = {name: queue.Queue() for name in self._declared or ()}
        self._lock = threading.Lock()
        self._closed = False

    def _queue(self, channel: str) -> queue.Queue:
        with self._lock:
            q = self._queues.get(channel)
            if q is None:
                if self._declared is not None:
                    raise ConnectorError(f"unknown channel {channel!r}; this connector has {list(self._declared)}")
                if not isinstance(channel, str):
                    raise ConnectorError(f"channel names are str, got {channel!r}")
                q = self._queues[channel] = queue.Queue()
            return q

    def put(self, channel: str, message: Message | tuple[str, dict, dict]) -> None:
        self._check_open()
        self._queue(channel).put(_check_message(message))

    def get(self, channel: str, timeout_s: float | None) -> Message:
        self._check_open()
        q, started, deadline = self._queue(channel), time.monotonic(), _deadline(timeout_s)
        while True:
            step = _step(deadline, self.settings.get_sleep_s)
            try:
                return q.get(timeout=step) if step > 0 else q.get_nowait()
            except queue.Empty:
                pass
            self._check_open()
            if deadline is not None and time.monotonic() >= deadline:
                raise _timeout_error(channel, timeout_s, started)

    def close(self) -> None:
        """Drop every queued message; a ``get`` waiting in another thread raises ConnectorError."""
        self._closed = True
        with self._lock:
            self._queues.clear()

    def cleanup(self, pid: int | None = None) -> int:
        """Nothing to clean up in one process; there for symmetry with SharedMemoryConnector."""
        return 0

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorError("the connector is closed")


# ---------------------------------------------------------------------------------------------- shared memory

# Segments this process created and that may not have been read yet: name -> creating pid. The pid guards
# against a forked child inheriting the dict and unlinking its parent's segments.
_OUTSTANDING: dict[str, int] = {}
_PRUNE_AT = [256]  # prune consumed names from _OUTSTANDING when it grows past this
_exit_hooks_pid: int | None = None
_finalizer_pid: int | None = None
_sigterm_pid: int | None = None
_hooks_lock = threading.Lock()


def _shm_create(name: str, size: int) -> SharedMemory:
    if _TRACK_KWARG:
        return SharedMemory(name, create=True, size=size, track=False)
    shm = SharedMemory(name, create=True, size=size)
    resource_tracker.unregister(shm._name, "shared_memory")  # we own its lifetime; see module docstring
    return shm


def _shm_attach(name: str) -> SharedMemory:
    if _TRACK_KWARG:
        return SharedMemory(name, track=False)
    shm = SharedMemory(name)
    resource_tracker.unregister(shm._name, "shared_memory")  # Python < 3.13 registers on attach too
    return shm


def _shm_unlink(name: str) -> bool:
    """Unlink a segment by name without the resource tracker; False if it was already gone."""
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink("/" + name)
        elif os.path.isdir(SHM_DIR):  # pragma: no cover
            os.unlink(os.path.join(SHM_DIR, name))
        else:  # pragma: no cover - Windows: the segment goes with its last handle
            return False
    except FileNotFoundError:
        return False
    return True


def _shm_close(shm: SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # a view is still alive (only after an error mid-copy); the mapping goes with it
        pass


def _unlink_outstanding(*_: Any) -> None:
    """Unlink the segments this process created that were not read; for atexit, finalizers and SIGTERM."""
    pid = os.getpid()
    for name, creator in list(_OUTSTANDING.items()):
        if creator == pid:
            _shm_unlink(name)
            _OUTSTANDING.pop(name, None)


def _on_sigterm_default(signum: int, frame: Any) -> None:
    _unlink_outstanding()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of SIGTERM as the process would have without us


def _install_exit_cleanup() -> None:
    """Once per process: atexit hook, multiprocessing finalizer (forked children skip atexit) and SIGTERM."""
    global _exit_hooks_pid, _finalizer_pid, _sigterm_pid
    pid = os.getpid()
    if _exit_hooks_pid == pid and _finalizer_pid == pid and _sigterm_pid == pid:
        return
    with _hooks_lock:
        if _exit_hooks_pid is None:  # atexit handlers survive a fork, so once per interpreter lineage
            atexit.register(_unlink_outstanding)
        _exit_hooks_pid = pid
        if _finalizer_pid != pid:  # a forked child starts with an empty finalizer registry
            mp_util.Finalize(None, _unlink_outstanding, exitpriority=10)
            _finalizer_pid = pid
        if _sigterm_pid != pid and threading.current_thread() is threading.main_thread():
            try:
                previous = signal.getsignal(signal.SIGTERM)
                if previous == signal.SIG_DFL:
                    signal.signal(signal.SIGTERM, _on_sigterm_default)
                elif callable(previous) and previous is not _on_sigterm_default and not getattr(
                    previous, "_m3s_chained", False
                ):

                    def chained(signum: int, frame: Any, _previous: Any = previous) -> None:
                        _unlink_outstanding()
                        _previous(signum, frame)

                    chained._m3s_chained = True  # type: ignore[attr-defined]
                    signal.signal(signal.SIGTERM, chained)
                # SIG_IGN, or a handler set outside Python: leave it alone (atexit still covers clean exits)
            except (ValueError, OSError):  # pragma: no cover - not allowed here
                pass
            _sigterm_pid = pid


def _prune_outstanding() -> None:
    """Forget segments a receiver already unlinked, so a long-lived sender's registry stays small."""
    if len(_OUTSTANDING) < _PRUNE_AT[0] or not os.path.isdir(SHM_DIR):
        return
    for name in list(_OUTSTANDING):
        if not os.path.exists(os.path.join(SHM_DIR, name)):
            _OUTSTANDING.pop(name, None)
    _PRUNE_AT[0] = max(256, 2 * len(_OUTSTANDING))


def _check_shm_space(size: int) -> None:
    """Writing past the free space of /dev/shm kills the writer with SIGBUS; refuse with a clear error instead."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return
    free = stats.f_bavail * stats.f_frsize
    if free < size:
        raise ConnectorError(
            f"{SHM_DIR} has {free / 2**20:.1f} MiB free but a message needs {size / 2**20:.1f} MiB; "
            "give the container a larger /dev/shm (docker --shm-size) or read messages faster"
        )


def _channel_names(channels: Iterable[str]) -> tuple[str, ...]:
    if isinstance(channels, str):
        channels = (channels,)
    names = tuple(channels)
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ConnectorError(f"channel names must be distinct non-empty strings, got {names!r}")
    return names


class _Channel(NamedTuple):
    reader: Any  # multiprocessing.connection.Connection
    writer: Any
    read_lock: Any  # multiprocessing.Lock: one reader at a time, messages are never interleaved
    write_lock: Any


def _new_channel(ctx: Any) -> _Channel:
    reader, writer = ctx.Pipe(duplex=False)
    if sys.platform.startswith("linux"):
        try:  # a larger pipe buffer: put blocks only once ~1 MiB of unread inline data is queued
            import fcntl

            fcntl.fcntl(writer.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:
            pass
    return _Channel(reader, writer, ctx.Lock(), ctx.Lock())


class SharedMemoryConnector:
    """Channels between processes; large tensors travel in shared memory (see the module docstring).

    A message whose tensors total ``shm_threshold_bytes`` or more (at or above the threshold) travels in shared
    memory; below it, inline through the channel's pipe. A message without tensor bytes is always inline.

    Build it in the parent before starting the workers (spawn context) and pass it to them as a Process
    argument. The channels must be known then: give them as ``channels=`` or with :meth:`open_channel` before
    the connector is first sent to another process. ``put`` returns once the message is in the pipe (it blocks
    only while the pipe holds ~1 MiB of unread inline messages); ``get`` checks for a message every
    ``connector_get_sleep_s`` until ``timeout_s``."""

    def __init__(
        self, extra: Mapping[str, Any] | ConnectorSettings | None = None, *, channels: Iterable[str] = ()
    ):
        self.settings = ConnectorSettings.from_extra(extra)
        self.prefix = f"m3s_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self._owner_pid = os.getpid()
        self._ctx = mp.get_context("spawn")
        self._channels: dict[str, _Channel] = {}
        self._shared = False
        self._init_local()
        for name in _channel_names(channels):
            self.open_channel(name)

    def _init_local(self) -> None:
        self._closed = False
        self._lock = threading.Lock()
        _install_exit_cleanup()

    # Sent to a worker as a Process argument: the pipes and locks go along (inheritance), local state does not.
    def __getstate__(self) -> dict[str, Any]:
        self._shared = True
        return {
            "settings": self.settings,
            "prefix": self.prefix,
            "owner_pid": self._owner_pid,
            "channels": self._channels,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.settings = state["settings"]
        self.prefix = state["prefix"]
        self._owner_pid = state["owner_pid"]
        self._channels = state["channels"]
        self._ctx = None
        self._shared = True
        self._init_local()

    @property
    def channels(self) -> tuple[str, ...]:
        return tuple(self._channels)

    @property
    def is_owner(self) -> bool:
        """True in the process that built the connector (the one that should call ``cleanup``)."""
        return os.getpid() == self._owner_pid

    def open_channel(self, name: str) -> None:
        """Add a channel; only in the owner and before the connector was sent to another process."""
        (name,) = _channel_names((name,))
        if self._shared or self._ctx is None:
            raise ConnectorError(
                f"cannot open channel {name!r}: the connector was already sent to another process; "
                "declare every channel before starting the workers"
            )
        if name not in self._channels:
            self._channels[name] = _new_channel(self._ctx)

    def _channel(self, channel: str) -> _Channel:
        try:
            return self._channels[channel]
        except (KeyError, TypeError):
            raise ConnectorError(f"unknown channel {channel!r}; this connector has {list(self._channels)}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorError("the connector is closed")

    def put(self, channel: str, message: Message | tuple[str, dict, dict]) -> None:
        self._check_open()
        ch = self._channel(channel)
        msg = _check_message(message)
        specs, total = _layout(msg.tensors)  # total: the buffer size, alignment padding included
        nbytes, segment = sum(spec.nbytes for spec in specs), None
        if nbytes > 0 and nbytes >= self.settings.shm_threshold_bytes:
            segment = self._write_segment(msg.tensors, specs, total)
            envelope = (msg.key, msg.meta, specs, segment, None)
        else:
            inline = bytearray(total)
            _pack(msg.tensors, specs, inline)
            envelope = (msg.key, msg.meta, specs, None, inline)
        try:
            data = pickle.dumps(envelope, protocol=pickle.HIGHEST_PROTOCOL)
            with ch.write_lock:
                ch.writer.send_bytes(data)
        except BaseException:
            if segment is not None:
                _shm_unlink(segment)
                _OUTSTANDING.pop(segment, None)
            if self._closed:
                raise ConnectorError("the connector was closed while sending") from None
            raise

    def _write_segment(self, tensors: Mapping[str, Any], specs: list[_Spec], total: int) -> str:
        _install_exit_cleanup()  # no-op after the first time in this process
        _prune_outstanding()
        _check_shm_space(total)
        pid = os.getpid()
        for _ in range(8):
            name = f"{self.prefix}{pid}_{secrets.token_hex(8)}"
            try:
                shm = _shm_create(name, total)
            except FileExistsError:
                continue
            break
        else:  # pragma: no cover - 64 random bits colliding 8 times
            raise ConnectorError("could not find a free shared-memory segment name")
        _OUTSTANDING[name] = pid
        try:
            _pack(tensors, specs, shm.buf)
        except BaseException:
            _shm_close(shm)
            _shm_unlink(name)
            _OUTSTANDING.pop(name, None)
            raise
        _shm_close(shm)
        return name

    def get(self, channel: str, timeout_s: float | None) -> Message:
        self._check_open()
        ch = self._channel(channel)
        started, deadline = time.monotonic(), _deadline(timeout_s)
        sleep_s = self.settings.get_sleep_s
        try:
            while not ch.read_lock.acquire(True, _step(deadline, sleep_s)):
                self._check_open()
                if deadline is not None and time.monotonic() >= deadline:
                    raise _timeout_error(channel, timeout_s, started)
            try:
                while not ch.reader.poll(_step(deadline, sleep_s)):
                    self._check_open()
                    if deadline is not None and time.monotonic() >= deadline:
                        raise _timeout_error(channel, timeout_s, started)
                data = ch.reader.recv_bytes()
            finally:
                ch.read_lock.release()
        except (OSError, EOFError, ValueError):
            if self._closed:
                raise ConnectorError(f"the connector was closed while waiting on channel {channel!r}") from None
            raise
        return self._decode(channel, data)

    def _decode(self, channel: str, data: bytes) -> Message:
        key, meta, specs, segment, inline = pickle.loads(data)
        if segment is None:
            return Message(key, meta, _unpack(specs, inline, copy=False))
        try:
            shm = _shm_attach(segment)
        except FileNotFoundError:
            _OUTSTANDING.pop(segment, None)
            raise ConnectorError(
                f"message {key!r} on channel {channel!r} lost its shared-memory segment {segment!r}: its sender "
                "closed the connector, exited or was cleaned up before the message was read"
            ) from None
        try:
            tensors = _unpack(specs, shm.buf, copy=True)
        finally:
            _shm_close(shm)
            _shm_unlink(segment)
            _OUTSTANDING.pop(segment, None)
        return Message(key, meta, tensors)

    def close(self) -> None:
        """Stop using the connector in this process and unlink the segments it sent that were not read.

        In the owner this ends the connector: every segment with its prefix is unlinked, whoever made it.
        Idempotent; a ``get`` waiting in another thread raises ConnectorError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        pid = os.getpid()
        for name, creator in list(_OUTSTANDING.items()):
            if creator == pid and name.startswith(self.prefix):
                _shm_unlink(name)
                _OUTSTANDING.pop(name, None)
        if self.is_owner:
            self.cleanup()
        for ch in self._channels.values():
            for conn in (ch.reader, ch.writer):
                try:
                    conn.close()
                except OSError:  # pragma: no cover
                    pass

    def cleanup(self, pid: int | None = None) -> int:
        """Unlink the segments of this connector still in /dev/shm: those created by process ``pid`` (say a
        worker that was killed), or all of them when ``pid`` is None. Returns how many were unlinked.

        Meant for the owner after a worker died (its unread messages are lost anyway) or at shutdown; with
        ``pid=None`` while workers still run, their messages in flight are lost. Works after ``close`` too."""
        pattern = self.prefix if pid is None else f"{self.prefix}{int(pid)}_"
        names = {name for name in list(_OUTSTANDING) if name.startswith(pattern)}
        if os.path.isdir(SHM_DIR):
            names.update(name for name in os.listdir(SHM_DIR) if name.startswith(pattern))
        removed = 0
        for name in names:
            removed += _shm_unlink(name)
            _OUTSTANDING.pop(name, None)
        return removed

    def segments(self, pid: int | None = None) -> list[str]:
        """Names of this connector's segments present in /dev/shm now (all, or those made by ``pid``)."""
        pattern = self.prefix if pid is None else f"{self.prefix}{int(pid)}_"
        if not os.path.isdir(SHM_DIR):
            return []
        return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(pattern))


# ------------------------------------------------------------------------------------------------------ factory

_KINDS = {"SharedMemoryConnector": SharedMemoryConnector}


def make_connector(
    kind_name: str, extra: Mapping[str, Any] | None = None, *, channels: Iterable[str] = ()
) -> SharedMemoryConnector:
    """The connector a deploy YAML names (``connectors.<name>.name``), built from its ``extra`` block."""
    cls = _KINDS.get(kind_name) if isinstance(kind_name, str) else None
    if cls is None:
        raise Music3Error(f"unknown connector {kind_name!r}; allowed: {', '.join(_KINDS)}")
    return cls(extra, channels=channels)
