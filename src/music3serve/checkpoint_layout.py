"""Where each component of the MiniMaxAI/MiniMax-Music3 diffusers layout lives on disk (folder, module class,
weight files, dtype, shards), its config read strictly, and the tensor names and shapes it holds."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .checkpoint_config import SUPPORTED, check_supported, checked_fields, config_values, read_json
from .errors import CheckpointError
from .models.condition_encoder import ConditionEncoder, ConditionEncoderConfig
from .models.depth_decoder import DepthDecoder, DepthDecoderConfig
from .models.dit import DiT, DiTConfig
from .models.language_model import LanguageModel, LanguageModelConfig
from .models.vocoder import Vocoder, VocoderConfig
from .models.weights import WeightNormSource

PIPELINE_CLASS = "MiniMaxMusic3ModularPipeline"


class Blocks(typing.NamedTuple):
    """A config value that counts a component's repeated blocks (an int, or a list with an item per block), the field
    of our config that holds it, and the prefix of the blocks' tensor names on disk (each followed by its index)."""

    key: str
    field: str
    prefix: str


@dataclass(frozen=True)
class Component:
    """One model folder of the checkpoint."""

    folder: str
    model: type[nn.Module]
    config: Callable[[dict[str, Any]], Any]
    weights: str  # safetensors file stem
    disk_dtype: torch.dtype
    shards: int  # shard count of the released checkpoint (the tiny one mirrors it)
    blocks: Blocks | None = None


COMPONENTS: dict[str, Component] = {
    "language_model": Component(
        "language_model", LanguageModel, LanguageModelConfig.from_json, "model", torch.bfloat16, 4,
        Blocks("num_hidden_layers", "layers", "model.layers."),
    ),
    "depth_decoder": Component(
        "rvq_depth_decoder", DepthDecoder, DepthDecoderConfig.from_json, "diffusion_pytorch_model", torch.bfloat16, 1,
        Blocks("num_layers", "layers", "layers."),
    ),
    "condition_encoder": Component(
        "condition_encoder", ConditionEncoder, ConditionEncoderConfig.from_json, "diffusion_pytorch_model",
        torch.float32, 1,
    ),
    "dit": Component(
        "transformer", DiT, DiTConfig.from_json, "diffusion_pytorch_model", torch.float32, 2,
        Blocks("num_layers", "layers", "transformer_blocks."),
    ),
    "vocoder": Component(
        "vocoder", Vocoder, VocoderConfig.from_json, "diffusion_pytorch_model", torch.float32, 1,
        Blocks("upsampling_ratios", "strides", "blocks."),
    ),
}


def component_folder(root: Path, name: str) -> Path:
    folder = Path(root) / COMPONENTS[name].folder
    if not folder.is_dir():
        raise CheckpointError(
            f"missing folder {folder} (expected the diffusers layout of MiniMaxAI/MiniMax-Music3)"
        )
    return folder


def load_config(root: Path, name: str) -> Any:
    path = component_folder(root, name) / "config.json"
    raw = read_json(path)
    check_supported(path, raw, SUPPORTED[name])
    with config_values(path):
        try:
            return checked_fields(COMPONENTS[name].config(raw), raw)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc


def checkpoint_tensors(name: str, cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape a component's safetensors hold (used to write checkpoints)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for source in COMPONENTS[name].model.checkpoint_sources(cfg).values():
        if isinstance(source, WeightNormSource):
            g_key, v_key = source.candidates()[0]
            shapes[g_key] = (source.shape[0],) + (1,) * (len(source.shape) - 1)
            shapes[v_key] = source.shape
        else:
            shapes.update({piece.key: piece.shape for piece in source})
    return shapes

