"""What every connector shares: the message and its checks, the settings, the errors and the bounded wait."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import Music3Error
from .deploy_schema import SharedMemoryExtra

_DEFAULTS = SharedMemoryExtra()  # what a connector's missing extra keys default to
_DEFAULT_EXTRA = _DEFAULTS.as_extra()  # the same under the YAML's key names (waits in milliseconds)


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


# --------------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class ConnectorSettings:
    """The ``extra`` block of a connector in the deploy YAML, with the waits converted to seconds."""

    codec_streaming: bool = _DEFAULTS.codec_streaming
    shm_threshold_bytes: int = _DEFAULTS.shm_threshold_bytes
    get_sleep_s: float = _DEFAULTS.connector_get_sleep_s
    first_chunk_timeout_s: float = _DEFAULTS.connector_get_max_wait_first_chunk_ms / 1000.0
    timeout_s: float = _DEFAULTS.connector_get_max_wait_ms / 1000.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | ConnectorSettings | None) -> ConnectorSettings:
        """Read the YAML keys (waits in MILLISECONDS there); a missing key keeps its default."""
        if extra is None:
            return cls()
        if isinstance(extra, ConnectorSettings):
            return extra
        if not isinstance(extra, Mapping):
            raise Music3Error(f"connector extra settings must be a mapping, got {type(extra).__name__}")
        unknown = sorted(set(extra) - set(_DEFAULT_EXTRA))
        if unknown:
            raise Music3Error(f"unknown connector setting(s) {unknown}; known: {sorted(_DEFAULT_EXTRA)}")
        codec_streaming = extra.get("codec_streaming", _DEFAULTS.codec_streaming)
        if not isinstance(codec_streaming, bool):
            raise Music3Error(f"connector setting codec_streaming must be true or false, got {codec_streaming!r}")
        threshold = extra.get("shm_threshold_bytes", _DEFAULTS.shm_threshold_bytes)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise Music3Error(f"connector setting shm_threshold_bytes must be an integer >= 0, got {threshold!r}")
        return cls(
            codec_streaming=codec_streaming,
            shm_threshold_bytes=threshold,
            get_sleep_s=_positive(extra, "connector_get_sleep_s"),
            first_chunk_timeout_s=_positive(extra, "connector_get_max_wait_first_chunk") / 1000.0,
            timeout_s=_positive(extra, "connector_get_max_wait") / 1000.0,
        )


def _positive(extra: Mapping[str, Any], key: str) -> float:
    value = extra.get(key, _DEFAULT_EXTRA[key])
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
        return sum(tensor_nbytes(t) for t in self.tensors.values())


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
