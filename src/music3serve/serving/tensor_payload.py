"""Tensors (torch or numpy) packed into one byte buffer and read back: where each one goes (64-byte aligned), the
copy in, and views or copies out. The shared-memory connector sends messages as such buffers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from .connector_base import tensor_nbytes

ALIGN = 64  # byte alignment of each tensor inside a payload buffer


class TensorSpec(NamedTuple):
    name: str
    kind: str  # "torch" or "numpy"
    dtype: Any  # torch.dtype or numpy.dtype (both pickle)
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout(tensors: Mapping[str, torch.Tensor | np.ndarray]) -> tuple[list[TensorSpec], int]:
    """Where each tensor goes in one payload buffer (64-byte aligned), and the buffer's size."""
    specs, end = [], 0
    for name, t in tensors.items():
        offset = -(-end // ALIGN) * ALIGN
        nbytes = tensor_nbytes(t)
        kind = "torch" if isinstance(t, torch.Tensor) else "numpy"
        specs.append(TensorSpec(name, kind, t.dtype, tuple(t.shape), offset, nbytes))
        end = offset + nbytes
    return specs, end


def _view(spec: TensorSpec, buf: Any) -> torch.Tensor | np.ndarray:
    """The tensor of ``spec`` as a view on the buffer (not for empty tensors: frombuffer refuses those)."""
    if spec.kind == "torch":
        count = spec.nbytes // spec.dtype.itemsize
        return torch.frombuffer(buf, dtype=spec.dtype, count=count, offset=spec.offset).view(spec.shape)
    return np.ndarray(spec.shape, spec.dtype, buffer=buf, offset=spec.offset)


def pack(tensors: Mapping[str, torch.Tensor | np.ndarray], specs: list[TensorSpec], buf: Any) -> None:
    """Copy the tensors into a writable buffer at the offsets of ``specs`` (one copy; CUDA tensors included)."""
    for spec in specs:
        if spec.nbytes == 0:
            continue
        src = tensors[spec.name]
        if spec.kind == "torch":
            _view(spec, buf).copy_(src.detach())
        else:
            _view(spec, buf)[...] = src


def unpack(specs: list[TensorSpec], buf: Any, copy: bool) -> dict[str, torch.Tensor | np.ndarray]:
    """Tensors from a payload buffer: views on it (``copy=False``, the buffer must be writable and private) or
    copies that do not hold on to it (``copy=True``, for shared memory that is unlinked right after)."""
    out: dict[str, torch.Tensor | np.ndarray] = {}
    for spec in specs:
        if spec.nbytes == 0:
            empty = torch.empty if spec.kind == "torch" else np.empty
            out[spec.name] = empty(spec.shape, dtype=spec.dtype)
        elif not copy:
            out[spec.name] = _view(spec, buf)
        elif spec.kind == "torch":
            out[spec.name] = _view(spec, buf).clone()
        else:
            out[spec.name] = _view(spec, buf).copy()
    return out
