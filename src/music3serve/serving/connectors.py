"""Connectors: how messages travel between stages and back to the API server.

A message is ``(key, meta, tensors)``: ``key`` names the request it belongs to, ``meta`` is a dict of JSON-able
values, ``tensors`` a dict of named ``torch.Tensor`` or ``numpy.ndarray``. In practice: window payloads
[200, 4096] float32 (3.3 MB) from stage 0 to stage 1, stereo PCM chunks [2, N] float32 from stage 1 back to the
API server, and small events with no tensors at all.

The one implementation is :class:`SharedMemoryConnector` (:mod:`.shared_memory`), between processes: large
tensors travel in shared-memory segments that never outlive their use (:mod:`.shm_segments`). Stages that share a
process (the colocated layout) need no connector: windows cross a plain queue there (:class:`.stage1.LocalStage1`).

The message, the errors and the bounded wait live in :mod:`.connector_base`; :func:`make_connector`
builds the connector a deploy YAML names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import Music3Error
from .connector_base import ConnectorError, ConnectorTimeout, LostMessage, Message, PeerGone
from .deploy_schema import SharedMemoryExtra
from .shared_memory import SharedMemoryConnector

__all__ = [
    "ConnectorError",
    "ConnectorTimeout",
    "LostMessage",
    "Message",
    "PeerGone",
    "SharedMemoryConnector",
    "make_connector",
]


_KINDS = {"SharedMemoryConnector": SharedMemoryConnector}


def make_connector(
    kind_name: str, extra: Mapping[str, Any] | SharedMemoryExtra | None = None, *, channels: Iterable[str] = ()
) -> SharedMemoryConnector:
    """The connector a deploy YAML names (``connectors.<name>.name``), built from its ``extra`` block."""
    cls = _KINDS.get(kind_name) if isinstance(kind_name, str) else None
    if cls is None:
        raise Music3Error(f"unknown connector {kind_name!r}; allowed: {', '.join(_KINDS)}")
    return cls(extra, channels=channels)
