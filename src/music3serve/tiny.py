"""Write a tiny random MiniMax-Music3 checkpoint in the released diffusers layout (tests and the demo use it): the
tiny configs, random weights at sane scales, sharded as the released checkpoint is, the tokenizer and the indexes."""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save

from . import contract
from .checkpoint_layout import COMPONENTS, PIPELINE_CLASS, checkpoint_tensors
from .errors import Music3Error
from .tiny_placement import (
    STAGING_PREFIX,
    current_folder,
    put_in_place,
    refuse_foreign_entries,
    remove_orphaned_staging,
)
from .tokenizer import write_tokenizer

DIFFUSERS_VERSION = "0.42.1"

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "language_model": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": contract.IM_END,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": contract.MAX_CONTEXT,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": contract.LM_VOCAB_SIZE,
    },
    "depth_decoder": {
        "_class_name": "MiniMaxMusic3RVQDepthDecoder",
        "hidden_size": 64,
        "num_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "audio_vocab_size": contract.RESIDUAL_CODES,
        "num_codebooks": contract.NUM_CODEBOOKS,
        "max_position_embeddings": 16,
    },
    "condition_encoder": {
        "_class_name": "MiniMaxMusic3ConditionEncoder",
        "condition_hidden_dim": 64,
        "num_condition_layers": contract.NUM_CODEBOOKS,
        "out_dim": 32,
        "input_sampling_rate": 24000,
        "input_hop_length": 960,
        "output_sampling_rate": contract.SAMPLE_RATE,
        "output_hop_length": contract.LATENT_HOP,
    },
    "dit": {
        "_class_name": "MiniMaxMusic3Transformer1DModel",
        "in_channels": contract.LATENT_CHANNELS,
        "condition_dim": 32,
        "num_layers": 2,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "ff_inner_dim": 64,
        "rotary_dim": 8,
        "fourier_embedding_dim": 16,
    },
    "vocoder": {
        "_class_name": "MiniMaxMusic3Vocoder",
        "latent_channels": contract.LATENT_CHANNELS,
        "decoder_input_dim": 32,
        "decoder_hidden_dim": 32,
        "upsampling_ratios": [8, 8, 4, 2],
        "sampling_rate": contract.SAMPLE_RATE,
    },
}

SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": DIFFUSERS_VERSION,
    "num_train_timesteps": 1,
    "shift": 1.0,
    "invert_sigmas": True,
}

PIPELINE_COMPONENTS = {
    "condition_encoder": ("diffusers", "MiniMaxMusic3ConditionEncoder"),
    "language_model": ("transformers", "Qwen3ForCausalLM"),
    "rvq_depth_decoder": ("diffusers", "MiniMaxMusic3RVQDepthDecoder"),
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "transformer": ("diffusers", "MiniMaxMusic3Transformer1DModel"),
    "vocoder": ("diffusers", "MiniMaxMusic3Vocoder"),
}


def random_tensor(key: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random weights at scales that keep activations of a tiny model in a sane range."""
    leaf = key.rsplit(".", 1)[-1]
    if key == "conv_out.weight_g":  # the vocoder's last conv: keep the waveform away from tanh saturation
        return 0.005 * (1.0 + 0.1 * torch.randn(shape, generator=gen))
    if leaf == "alpha" or key.endswith("layer_scale") or leaf == "weight_g" or (
        "norm" in key and leaf == "weight"
    ):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if leaf == "bias":
        return 0.02 * torch.randn(shape, generator=gen)
    if "embed" in key and "time_embed" not in key or leaf == "layer_weight_logits":
        return torch.randn(shape, generator=gen)
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A .safetensors file created as open() creates one, 0o666 less the umask like the configs beside it:
    safetensors' save_file writes a temporary file and renames it into place, which left the weights 0o600 (a
    checkpoint root made in an image build could not be read by the service's own user)."""
    path.write_bytes(save(tensors, metadata={"format": "pt"}))


def _write_weights(folder: Path, stem: str, tensors: dict[str, torch.Tensor], shards: int) -> None:
    keys = list(tensors)
    if shards == 1:
        _save(tensors, folder / f"{stem}.safetensors")
        return
    per_shard = math.ceil(len(keys) / shards)
    weight_map: dict[str, str] = {}
    for index in range(shards):
        name = f"{stem}-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {key: tensors[key] for key in keys[index * per_shard : (index + 1) * per_shard]}
        _save(part, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def write_component(
    directory: Path, name: str, overrides: dict[str, Any], tensor: Callable[[str, tuple[int, ...]], torch.Tensor]
) -> None:
    """One component's folder: its config (the tiny one with `overrides`) and weights, tensor(key, shape) each."""
    component = COMPONENTS[name]
    folder = Path(directory) / component.folder
    folder.mkdir(parents=True, exist_ok=True)
    raw = {**TINY_CONFIGS[name], **overrides}
    if "_class_name" in raw:
        raw["_diffusers_version"] = DIFFUSERS_VERSION
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    shapes = checkpoint_tensors(name, component.config(raw))
    tensors = {key: tensor(key, shape).to(component.disk_dtype) for key, shape in shapes.items()}
    _write_weights(folder, component.weights, tensors, component.shards)


def write_tiny_checkpoint(
    directory: Path, seed: int = 0, overrides: dict[str, dict[str, Any]] | None = None
) -> Path:
    """Write every component folder, config, index and the tokenizer; returns the directory. overrides: config values
    per component that replace the tiny ones (a wider model for the GPU precision tests)."""
    directory, overrides = Path(directory), overrides or {}
    unknown = set(overrides) - set(COMPONENTS)
    if unknown:
        raise ValueError(f"overrides for unknown components {sorted(unknown)}; known: {sorted(COMPONENTS)}")
    gen = torch.Generator().manual_seed(seed)
    for name in COMPONENTS:
        write_component(directory, name, overrides.get(name, {}), lambda key, shape: random_tensor(key, shape, gen))
    (directory / "scheduler").mkdir(exist_ok=True)
    (directory / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2))
    write_tokenizer(directory / "tokenizer")
    # The keys diffusers' own ModularPipeline.save_pretrained writes; without _blocks_class_name,
    # ModularPipeline.from_pretrained cannot resolve the pipeline blocks.
    index = {
        "_blocks_class_name": "MiniMaxMusic3Blocks",
        "_class_name": PIPELINE_CLASS,
        "_diffusers_version": DIFFUSERS_VERSION,
    }
    for folder, (library, cls) in PIPELINE_COMPONENTS.items():
        spec = {"pretrained_model_name_or_path": None, "revision": None, "subfolder": folder,
                "type_hint": [library, cls], "variant": None}
        index[folder] = [library, cls, spec]
    (directory / "modular_model_index.json").write_text(json.dumps(index, indent=2))
    return directory


def write_tiny(target: Path, seed: int = 0, replace: bool = True) -> None:
    """A tiny random checkpoint written whole into a staging folder beside `target`, then put in its place (the
    staging folder goes on any failure or interrupt; what `target` held is replaced only at the end). replace
    False: a complete checkpoint another process put there meanwhile stays (it may be loading from it)."""
    blocking = next((p for p in target.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise Music3Error(f"cannot write a checkpoint to {target}: {blocking} is a file, not a folder")
    target = Path(os.path.realpath(target))  # "." or a link: the folder it names, whose parent holds the staging
    here = current_folder()
    if here is not None and target.exists() and target in (here, *here.parents):
        raise Music3Error(f"{target} is the current folder or holds it, and a checkpoint replaces its folder whole: "
                          "run from another folder")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_orphaned_staging(target.parent)
        staging = target.parent / f"{STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        staging.mkdir()  # as mkdir(1) makes a folder (0o777 less the umask; mkdtemp's are 0o700)
    except OSError as exc:
        raise Music3Error(f"cannot write a checkpoint to {target}: {exc.strerror or exc}") from None
    try:
        write_tiny_checkpoint(staging, seed=seed)
        if replace or not (target / "modular_model_index.json").is_file():
            refuse_foreign_entries(target, staging)
            put_in_place(staging, target)
    except OSError as exc:  # named by the target, not by the staging folder the user never asked for
        raise Music3Error(f"cannot write a checkpoint to {target}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone after the rename; here on a failure or a lost race
