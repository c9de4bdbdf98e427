"""Memory-mapped reading of a component's safetensors: which file holds each tensor (one file, or shards listed in an
index), each tensor checked for name, shape and dtype, and copied into our parameters."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .checkpoint_config import read_json
from .errors import CheckpointError
from .models.weights import ParamSource, WeightNormSource


def weight_files(folder: Path, stem: str) -> dict[str, Path]:
    """Map every tensor name to its safetensors file (single file, or shards listed in an index)."""
    single, index = folder / f"{stem}.safetensors", folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        if not weight_map:
            raise CheckpointError(f"{index} lists no tensors (its 'weight_map' is empty)")
        for key, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file:  # shards sit beside their index
                raise CheckpointError(f"{index} maps tensor '{key}' to {file!r}, expected a file name in {folder}")
        return {key: folder / file for key, file in weight_map.items()}
    if single.is_file():
        with ExitStack() as stack:
            keys = _open(single, stack).keys()
        if not keys:
            raise CheckpointError(f"{single} holds no tensors")
        return {key: single for key in keys}
    raise CheckpointError(f"no weights in {folder}: expected {single.name} or {index.name}")


def _open(path: Path, stack: ExitStack):
    if not path.is_file():
        raise CheckpointError(f"missing weight file {path}")
    try:
        path.open("rb").close()  # safetensors reports every file it cannot open as "No such file or directory"
        return stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from exc


# safetensors dtypes a weight may have on disk; integers, booleans and fp8 (which needs scales) would be cast wrongly.
WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64")


def first_names(names: list[str]) -> str:
    """The first five of a sorted list of tensor names, for an error message."""
    return f"{names[:5]}{' ...' if len(names) > 5 else ''}"


class TensorReader:
    """Memory-mapped access to the tensors of one component, with file-and-name errors."""

    def __init__(self, folder: Path, files: dict[str, Path], stack: ExitStack):
        self.folder, self.files = folder, files
        for path in sorted(set(files.values())):
            if not path.is_file():
                listed = sorted(key for key, where in files.items() if where == path)
                raise CheckpointError(
                    f"missing weight file {path}, where the index puts tensors {listed[:3]}{' ...' if len(listed) > 3 else ''}"
                )
        self.handles = {path: _open(path, stack) for path in set(files.values())}
        for key, path in files.items():
            if key not in self.handles[path].keys():
                raise CheckpointError(f"{path} lacks tensor '{key}' that its index lists")
        for path, handle in self.handles.items():  # a shard's tensor the index leaves out would be ignored silently
            unlisted = sorted(set(handle.keys()) - set(files))
            if unlisted:
                raise CheckpointError(f"{path} holds tensors its index does not list: {first_names(unlisted)}")

    def view(self, key: str, shape: tuple[int, ...]) -> Any:
        """The tensor's unread slice, once it is there with the expected shape and a weight dtype."""
        if key not in self.files:
            raise CheckpointError(f"missing tensor '{key}' in {self.folder}")
        path = self.files[key]
        view = self.handles[path].get_slice(key)
        found = tuple(view.get_shape())
        if found != shape:
            raise CheckpointError(f"tensor '{key}' in {path} has shape {list(found)}, expected {list(shape)}")
        if view.get_dtype() not in WEIGHT_DTYPES:
            raise CheckpointError(
                f"tensor '{key}' in {path} has dtype {view.get_dtype()}, expected a floating-point one "
                f"({', '.join(WEIGHT_DTYPES)})"
            )
        return view

    def read(self, key: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None) -> torch.Tensor:
        view = self.view(key, shape)
        try:
            return view[rows[0] : rows[1]] if rows else view[:]
        except Exception as exc:  # safetensors raises several types for truncated data
            raise CheckpointError(f"cannot read tensor '{key}' from {self.files[key]}: {exc}") from exc


def fill_parameter(param: torch.Tensor, source: ParamSource, reader: TensorReader) -> None:
    with torch.no_grad():
        if isinstance(source, WeightNormSource):
            (g_key, g_shape), (v_key, v_shape) = tensors_of(source, reader)
            g, v = reader.read(g_key, g_shape), reader.read(v_key, v_shape)
            param.copy_(torch._weight_norm(v.to(param.device, torch.float32), g.to(param.device, torch.float32), 0))
            return
        flat, offset = param.view(-1), 0
        for piece in source:
            data = reader.read(piece.key, piece.shape, piece.rows).reshape(-1)
            if offset + data.numel() > flat.numel():
                raise CheckpointError(f"tensor '{piece.key}' does not fit our parameter of shape {list(param.shape)}")
            flat[offset : offset + data.numel()].copy_(data)
            offset += data.numel()
        if offset != flat.numel():
            raise CheckpointError(f"tensors {[p.key for p in source]} do not fill shape {list(param.shape)}")


def tensors_of(source: ParamSource, reader: TensorReader) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each checkpoint tensor a parameter reads; a weight norm's g and v in the naming on disk."""
    if not isinstance(source, WeightNormSource):
        return [(piece.key, piece.shape) for piece in source]
    g_shape = (source.shape[0],) + (1,) * (len(source.shape) - 1)
    for g_key, v_key in source.candidates():
        if g_key in reader.files:
            return [(g_key, g_shape), (v_key, source.shape)]
    raise CheckpointError(
        f"missing weight-norm tensors '{source.prefix}.weight_g' / '{source.prefix}.weight_v' in {reader.folder}"
    )


def source_keys(source: ParamSource, present: set[str]) -> set[str]:
    """Checkpoint tensor names a parameter reads."""
    if isinstance(source, WeightNormSource):
        for pair in source.candidates():
            if pair[0] in present:
                return set(pair)
        return set(source.candidates()[0])
    return {piece.key for piece in source}

