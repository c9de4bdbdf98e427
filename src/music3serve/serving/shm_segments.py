"""Shared-memory segments: create, fill, read once, and never leak (/dev/shm is RAM, and small in containers).

- Every segment is named ``<prefix><creator pid>_<random>``; a connector's prefix is ``m3s_<owner pid>_<uuid8>_``,
  so a segment says which connector and which process made it.
- The receiver unlinks a segment as soon as it has copied the tensors out (:func:`read_segment`).
- Each process keeps a registry of the segments it created and that may not have been read yet. A connector's
  ``close()`` unlinks this process's outstanding segments (:func:`unlink_unread`); in the process that built the
  connector (the owner) it also unlinks every segment with the connector's prefix, since the connector is over.
- At interpreter exit (atexit, and multiprocessing's finalizers, which also run in forked children) and on
  SIGTERM (a handler installed when the SIGTERM disposition is still the default, or chained before a Python
  handler) a process unlinks the segments it created that were not read yet. Messages put and never read are
  dropped when their sender exits: a sender that wants its last messages delivered waits for the reader.
- SIGKILL cannot be caught, so the owner (the orchestrator) unlinks every segment a dead worker created, found by
  prefix in /dev/shm (:func:`unlink_segments`).
- Python's ``resource_tracker`` is kept out of it on purpose: it would unlink segments of a process that exits
  (warning about "leaked" objects that another process still has to read) and, on Python < 3.13, registers a
  segment again in every process that attaches to it, which ends in double-unlink warnings. Here the creator
  and the receiver unregister right after creating or attaching (``track=False`` on 3.13+), and unlinking is done
  by name without the tracker.

Linux is the target: the prefix scan reads /dev/shm; elsewhere only the segments this process created are known.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing import util as mp_util
from multiprocessing.shared_memory import SharedMemory
from typing import Any, TypeVar

from .connector_base import ConnectorError

try:  # POSIX: unlink a segment by name without mapping it or involving the resource tracker
    import _posixshmem
except ImportError:  # pragma: no cover - Windows, where a segment dies with its last handle
    _posixshmem = None

SHM_DIR = "/dev/shm"
_TRACK_KWARG = sys.version_info >= (3, 13)  # SharedMemory(track=False) exists from 3.13

# Segments this process created and that may not have been read yet: name -> creating pid. The pid guards
# against a forked child inheriting the dict and unlinking its parent's segments.
_OUTSTANDING: dict[str, int] = {}
PRUNE_AT_LEAST = 256  # the registry's smallest cap
_prune_at = PRUNE_AT_LEAST  # forget consumed names once the registry holds this many
_atexit_registered = False  # atexit handlers survive a fork: once per interpreter lineage
_finalizer_pid: int | None = None  # a forked child starts with an empty finalizer registry: once per process
_sigterm_pid: int | None = None
_hooks_lock = threading.Lock()

_T = TypeVar("_T")


def write_segment(prefix: str, size: int, fill: Callable[[memoryview], None]) -> str:
    """Create a segment of ``size`` bytes named after ``prefix`` and this process, ``fill`` it, return its name."""
    install_exit_cleanup()  # no-op after the first time in this process
    _prune_outstanding()
    _check_free_space(size)
    pid = os.getpid()
    for _ in range(8):
        name = f"{prefix}{pid}_{secrets.token_hex(8)}"
        try:
            shm = _create(name, size)
        except FileExistsError:
            continue
        break
    else:  # pragma: no cover - 64 random bits colliding 8 times
        raise ConnectorError("could not find a free shared-memory segment name")
    _OUTSTANDING[name] = pid
    try:
        fill(shm.buf)
    except BaseException:
        _close(shm)
        unlink_segment(name)
        raise
    _close(shm)
    return name


def read_segment(name: str, read: Callable[[memoryview], _T]) -> _T:
    """``read`` the segment's bytes (copying what it keeps), then unlink it; FileNotFoundError if it is gone."""
    try:
        shm = _attach(name)
    except FileNotFoundError:
        _OUTSTANDING.pop(name, None)
        raise
    try:
        return read(shm.buf)
    finally:
        _close(shm)
        unlink_segment(name)


def unlink_segment(name: str) -> bool:
    """Unlink a segment by name, without the resource tracker, and forget it; False if it was already gone."""
    _OUTSTANDING.pop(name, None)
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


def unlink_unread(prefix: str = "") -> None:
    """Unlink the segments this process created (with ``prefix``) that were not read yet."""
    pid = os.getpid()
    for name, creator in list(_OUTSTANDING.items()):
        if creator == pid and name.startswith(prefix):
            unlink_segment(name)


def unlink_segments(prefix: str) -> int:
    """Unlink every segment with ``prefix``, whichever process made it; returns how many."""
    names = {name for name in list(_OUTSTANDING) if name.startswith(prefix)}
    names.update(list_segments(prefix))
    return sum(unlink_segment(name) for name in names)


def list_segments(prefix: str) -> list[str]:
    """Names of the segments with ``prefix`` present in /dev/shm now."""
    if not os.path.isdir(SHM_DIR):
        return []
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def _create(name: str, size: int) -> SharedMemory:
    if _TRACK_KWARG:
        return SharedMemory(name, create=True, size=size, track=False)
    shm = SharedMemory(name, create=True, size=size)
    resource_tracker.unregister(shm._name, "shared_memory")  # we own its lifetime; see the module docstring
    return shm


def _attach(name: str) -> SharedMemory:
    if _TRACK_KWARG:
        return SharedMemory(name, track=False)
    shm = SharedMemory(name)
    resource_tracker.unregister(shm._name, "shared_memory")  # Python < 3.13 registers on attach too
    return shm


def _close(shm: SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # a view is still alive (only after an error mid-copy); the mapping goes with it
        pass


def _prune_outstanding() -> None:
    """Forget segments a receiver already unlinked, so a long-lived sender's registry stays small."""
    global _prune_at
    if len(_OUTSTANDING) < _prune_at or not os.path.isdir(SHM_DIR):
        return
    for name in list(_OUTSTANDING):
        if not os.path.exists(os.path.join(SHM_DIR, name)):
            _OUTSTANDING.pop(name, None)
    _prune_at = max(PRUNE_AT_LEAST, 2 * len(_OUTSTANDING))


def _check_free_space(size: int) -> None:
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


# ------------------------------------------------------------------------------------------- exit and SIGTERM


def install_exit_cleanup() -> None:
    """Once per process: atexit hook, multiprocessing finalizer (forked children skip atexit) and SIGTERM."""
    global _atexit_registered, _finalizer_pid
    pid = os.getpid()
    if _finalizer_pid == pid and _sigterm_pid == pid:
        return
    with _hooks_lock:
        if not _atexit_registered:
            atexit.register(unlink_unread)
            _atexit_registered = True
        if _finalizer_pid != pid:
            mp_util.Finalize(None, unlink_unread, exitpriority=10)
            _finalizer_pid = pid
        if _sigterm_pid != pid and threading.current_thread() is threading.main_thread():
            _install_sigterm_handler(pid)


def _install_sigterm_handler(pid: int) -> None:
    """Unlink unread segments on SIGTERM: our handler in place of the default, or chained before a Python one."""
    global _sigterm_pid
    try:
        previous = signal.getsignal(signal.SIGTERM)
        ours = previous is _on_sigterm_default or getattr(previous, "_m3s_chained", False)
        if previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm_default)
        elif callable(previous) and not ours:  # a forked child inherits our handler: it is already in place

            def chained(signum: int, frame: Any, _previous: Any = previous) -> None:
                unlink_unread()
                _previous(signum, frame)

            chained._m3s_chained = True  # type: ignore[attr-defined]
            signal.signal(signal.SIGTERM, chained)
        # SIG_IGN, or a handler set outside Python: leave it alone (atexit still covers clean exits)
    except (ValueError, OSError):  # pragma: no cover - not allowed here
        pass
    _sigterm_pid = pid


def _on_sigterm_default(signum: int, frame: Any) -> None:
    unlink_unread()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of SIGTERM as the process would have without us
