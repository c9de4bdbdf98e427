"""SharedMemoryConnector: channels between processes (multiprocessing, spawn context).

A message whose tensors total fewer than ``shm_threshold_bytes`` travels inline through the channel's pipe; at or
above the threshold its tensors are copied into one shared-memory segment and the pipe carries only the segment's
name and the tensors' dtypes, shapes and offsets. The receiver maps the segment, copies the tensors out into memory
of its own, then unlinks the segment. The buffer's layout: :mod:`.tensor_payload`; how segments are kept from
leaking: :mod:`.shm_segments`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import threading
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from . import shm_segments
from .connector_base import (
    BoundedWait,
    ConnectorError,
    LostMessage,
    Message,
    PeerGone,
    channel_names,
    check_message,
)
from .deploy_config import connector_extra
from .deploy_schema import SharedMemoryExtra
from .tensor_payload import layout, pack, unpack

_F_SETPIPE_SZ = 1031  # Linux fcntl: grow a pipe's buffer
_PIPE_BYTES = 1 << 20  # ask for 1 MiB of pipe buffer (the unprivileged maximum by default)


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
        self, extra: Mapping[str, Any] | SharedMemoryExtra | None = None, *, channels: Iterable[str] = ()
    ):
        self.settings = extra if isinstance(extra, SharedMemoryExtra) else connector_extra(extra)
        self.prefix = f"m3s_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self._owner_pid = os.getpid()
        self._ctx = mp.get_context("spawn")
        self._channels: dict[str, _Channel] = {}
        self._shared = False
        self._init_local()
        for name in channel_names(channels):
            self.open_channel(name)

    def _init_local(self) -> None:
        self._closed = False
        self._lock = threading.Lock()
        shm_segments.install_exit_cleanup()

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
    def is_owner(self) -> bool:
        """True in the process that built the connector (the one that should call ``cleanup``)."""
        return os.getpid() == self._owner_pid

    def open_channel(self, name: str) -> None:
        """Add a channel; only in the owner and before the connector was sent to another process."""
        (name,) = channel_names((name,))
        if self._shared:
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
        msg = check_message(message)
        specs, size = layout(msg.tensors)  # size: the buffer's, alignment padding included
        nbytes, segment = sum(spec.nbytes for spec in specs), None
        if nbytes > 0 and nbytes >= self.settings.shm_threshold_bytes:
            segment = shm_segments.write_segment(self.prefix, size, lambda buf: pack(msg.tensors, specs, buf))
            envelope = (msg.key, msg.meta, specs, segment, None)
        else:
            inline = bytearray(size)
            pack(msg.tensors, specs, inline)
            envelope = (msg.key, msg.meta, specs, None, inline)
        try:
            data = pickle.dumps(envelope, protocol=pickle.HIGHEST_PROTOCOL)
            with ch.write_lock:
                ch.writer.send_bytes(data)
        except BaseException as exc:
            if segment is not None:
                shm_segments.unlink_segment(segment)
            if self._closed:
                raise ConnectorError("the connector was closed while sending") from None
            if isinstance(exc, BrokenPipeError):
                raise PeerGone(f"channel {channel!r} has no reader left: its process is gone") from None
            raise

    def get(self, channel: str, timeout_s: float | None) -> Message:
        self._check_open()
        ch = self._channel(channel)
        wait = BoundedWait(channel, timeout_s, self.settings.connector_get_sleep_s)
        try:
            while not ch.read_lock.acquire(True, wait.step()):
                self._check_open()
                wait.check_expired()
            try:
                while not ch.reader.poll(wait.step()):
                    self._check_open()
                    wait.check_expired()
                data = ch.reader.recv_bytes()
            finally:
                ch.read_lock.release()
        except (OSError, EOFError, ValueError) as exc:
            if self._closed:
                raise ConnectorError(f"the connector was closed while waiting on channel {channel!r}") from None
            if isinstance(exc, (EOFError, OSError)):  # end of file at a message's start, or in its middle
                raise PeerGone(f"channel {channel!r} has no sender left: its process is gone ({exc})") from None
            raise
        return self._decode(channel, data)

    def release(self, channel: str, end: str) -> None:
        """Close this process's copy of one end ("reader" or "writer") of a channel it never uses, once the other
        process holds its own copy: a peer that dies is then seen at once (a reader gets end of file, a writer a
        broken pipe) instead of a wait on a pipe this process itself keeps open."""
        if end not in ("reader", "writer"):
            raise ConnectorError(f"end must be 'reader' or 'writer', got {end!r}")
        getattr(self._channel(channel), end).close()

    def _decode(self, channel: str, data: bytes) -> Message:
        key, meta, specs, segment, inline = pickle.loads(data)
        if segment is None:
            return Message(key, meta, unpack(specs, inline, copy=False))
        try:
            tensors = shm_segments.read_segment(segment, lambda buf: unpack(specs, buf, copy=True))
        except FileNotFoundError:
            raise LostMessage(
                f"message {key!r} on channel {channel!r} lost its shared-memory segment {segment!r}: its sender "
                "closed the connector, exited or was cleaned up before the message was read", meta
            ) from None
        return Message(key, meta, tensors)

    def close(self) -> None:
        """Stop using the connector in this process and unlink the segments it sent that were not read.

        In the owner this ends the connector: every segment with its prefix is unlinked, whoever made it.
        Idempotent; a ``get`` waiting in another thread raises ConnectorError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        shm_segments.unlink_unread(self.prefix)
        if self.is_owner:
            self.cleanup()
        for ch in self._channels.values():
            for conn in (ch.reader, ch.writer):
                try:
                    conn.close()
                except OSError:  # pragma: no cover
                    pass

    def cleanup(self) -> int:
        """Unlink every segment of this connector still in /dev/shm, whichever process created it. Returns how many
        were unlinked.

        Meant for the owner after a worker died (its unread messages are lost anyway) or at shutdown; while workers
        still run, their messages in flight are lost. Works after ``close`` too."""
        return shm_segments.unlink_segments(self.prefix)
