"""What every connector shares: the message and its checks, the errors and the bounded wait."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import Music3Error


class ConnectorError(Music3Error):
    """A message could not be sent or received (closed connector, unknown channel, lost segment, ...)."""


class ConnectorTimeout(ConnectorError):
    """``get`` waited as long as it was allowed to and no message arrived on the channel."""


class PeerGone(ConnectorError):
    """The process at the other end of the channel is gone (end of file, also in the middle of a message, or a
    broken pipe)."""


class LostMessage(ConnectorError):
    """A message arrived without its payload (its shared-memory segment was removed first); ``meta`` is its own."""

    def __init__(self, message: str, meta: dict[str, Any]):
        super().__init__(message)
        self.meta = meta


# ---------------------------------------------------------------------------------------------------- messages


class Message(NamedTuple):
    key: str
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor | np.ndarray]


def tensor_nbytes(t: torch.Tensor | np.ndarray) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else int(t.nbytes)


def check_message(message: Any) -> Message:
    """What a message must be before it is sent: a str key, JSON-able meta, dense tensors or plain arrays."""
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


def channel_names(channels: Iterable[str]) -> tuple[str, ...]:
    """The declared channels as a tuple (one name alone is one channel); distinct non-empty strings."""
    if isinstance(channels, str):
        channels = (channels,)
    names = tuple(channels)
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ConnectorError(f"channel names must be distinct non-empty strings, got {names!r}")
    return names


# ------------------------------------------------------------------------------------------------------ waiting


class BoundedWait:
    """A ``get``'s wait on one channel, in poll-interval steps until ``timeout_s`` (None: no limit, 0: no wait)."""

    def __init__(self, channel: str, timeout_s: float | None, sleep_s: float):
        if timeout_s is not None and (
            not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or math.isnan(timeout_s)
        ):
            raise ConnectorError(f"timeout_s must be a number of seconds or None, got {timeout_s!r}")
        self.channel, self.timeout_s, self.sleep_s = channel, timeout_s, sleep_s
        self.started = time.monotonic()
        self.deadline = None if timeout_s is None else self.started + max(0.0, float(timeout_s))

    def step(self) -> float:
        """How long the next wait may last: the poll interval, cut at the deadline."""
        if self.deadline is None:
            return self.sleep_s
        return max(0.0, min(self.sleep_s, self.deadline - time.monotonic()))

    def check_expired(self) -> None:
        """Raise ConnectorTimeout once the deadline has passed."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            waited = time.monotonic() - self.started
            raise ConnectorTimeout(
                f"no message on channel {self.channel!r} after waiting {waited:.3f} s (timeout {self.timeout_s} s); "
                "the sending stage is slow, stuck or gone"
            )
