"""The checks that refuse a checkpoint our modules cannot run, naming the file and the value: the pipeline index and
scheduler, configs that do not fit each other or the contract, block counts the weights do not hold, empty
parameters, and weights that hold NaN or inf."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from . import contract
from .checkpoint_config import SUPPORTED, as_json, check_supported, read_json
from .checkpoint_layout import PIPELINE_CLASS, Blocks, component_folder, load_config
from .checkpoint_reader import TensorReader, tensors_of
from .errors import CheckpointError
from .models.weights import ParamSource


def check_layout(root: Path) -> None:
    """The pipeline index and scheduler say this is a MiniMax-Music3 checkpoint with its fixed schedule."""
    if not Path(root).is_dir():
        what = "is not a folder" if Path(root).exists() else "does not exist"
        raise CheckpointError(f"model folder {root} {what}")
    index_file = Path(root) / "modular_model_index.json"
    if not index_file.is_file():
        raise CheckpointError(f"{root} is not a MiniMax-Music3 checkpoint folder: it has no {index_file.name} (the "
                              "folder `hf download MiniMaxAI/MiniMax-Music3 --local-dir DIR` writes; --tiny for a "
                              "small random one)")
    index = read_json(index_file)
    if index.get("_class_name") != PIPELINE_CLASS:
        raise CheckpointError(f"{index_file} is not a {PIPELINE_CLASS}'s (its _class_name is "
                              f"{as_json(index.get('_class_name'))})")
    scheduler = Path(root) / "scheduler" / "scheduler_config.json"
    check_supported(scheduler, read_json(scheduler), SUPPORTED["scheduler"])


def check_fit(root: Path) -> None:
    """The components' configs fit each other, the contract and the shapes attention and rotary embeddings need (each
    of them may load on its own and still not): a mismatch fails the load, naming the config and the value, instead of
    the first song or the audio's speed."""
    names = ("language_model", "depth_decoder", "condition_encoder", "dit", "vocoder")
    lm, depth, encoder, dit, vocoder = (load_config(root, name) for name in names)
    lm_hidden = f"{lm.hidden}, the language model's hidden_size"
    codes = contract.AUDIO_CODE_OFFSET + contract.SEMANTIC_CODES
    checks = [
        ("language_model", "vocab_size", lm.vocab, lm.vocab >= codes, f"at least {codes}, the last audio code + 1"),
        ("language_model", "num_key_value_heads", lm.kv_heads, lm.heads % lm.kv_heads == 0,
         f"a divisor of num_attention_heads ({lm.heads})"),
        ("language_model", "head_dim", lm.head_dim, lm.head_dim % 2 == 0, "an even number (rotary pairs)"),
        ("language_model", "max_position_embeddings", lm.max_positions, lm.max_positions >= contract.MAX_CONTEXT,
         f"at least {contract.MAX_CONTEXT}, the context (prompt + song) the engine gives a row"),
        ("depth_decoder", "num_attention_heads", depth.heads, depth.hidden % depth.heads == 0,
         f"a divisor of hidden_size ({depth.hidden})"),
        ("depth_decoder", "hidden_size", depth.hidden, depth.hidden == lm.hidden, lm_hidden),
        ("depth_decoder", "num_codebooks", depth.codebooks, depth.codebooks == contract.NUM_CODEBOOKS,
         f"{contract.NUM_CODEBOOKS}, the codebooks of a frame"),
        ("depth_decoder", "max_position_embeddings", depth.positions, depth.positions >= contract.NUM_CODEBOOKS,
         f"at least {contract.NUM_CODEBOOKS}, the positions of a frame"),
        ("condition_encoder", "condition_hidden_dim", encoder.hidden, encoder.hidden == lm.hidden, lm_hidden),
        ("condition_encoder", "num_condition_layers", encoder.streams, encoder.streams == contract.NUM_CODEBOOKS,
         f"{contract.NUM_CODEBOOKS}, the hidden states of a frame"),
        ("dit", "in_channels", dit.channels, dit.channels == contract.LATENT_CHANNELS,
         f"{contract.LATENT_CHANNELS}, the latent channels"),
        ("dit", "condition_dim", dit.condition, dit.condition == encoder.out_dim,
         f"{encoder.out_dim}, the condition encoder's out_dim"),
        ("dit", "rotary_dim", dit.rotary_dim, dit.rotary_dim % 2 == 0 and dit.rotary_dim <= dit.head_dim,
         f"an even number up to attention_head_dim ({dit.head_dim})"),
        ("dit", "fourier_embedding_dim", dit.fourier, dit.fourier % 2 == 0, "an even number (sines and cosines)"),
        ("vocoder", "latent_channels", vocoder.latent_channels, vocoder.latent_channels == contract.LATENT_CHANNELS,
         f"{contract.LATENT_CHANNELS}, the latent channels"),
        ("vocoder", "upsampling_ratios", list(vocoder.strides), math.prod(vocoder.strides) == contract.LATENT_HOP,
         f"ratios that multiply to {contract.LATENT_HOP}, the samples of a latent column"),
        ("vocoder", "sampling_rate", vocoder.sample_rate, vocoder.sample_rate == contract.SAMPLE_RATE,
         f"{contract.SAMPLE_RATE}, the rate the model was trained at"),
    ]
    for name, key, found, fits, expected in checks:
        if not fits:
            raise CheckpointError(f"{component_folder(root, name) / 'config.json'}: {key} is {as_json(found)}, "
                                  f"expected {expected}")


def check_nonempty(module: nn.Module, path: Path) -> None:
    """Every parameter has elements: sizes that leave one empty (widths halved to 0) fail here, naming it; folding the
    weight norm of an empty conv would kill the process with a floating point exception."""
    for name, param in module.named_parameters():
        if param.numel() == 0:
            raise CheckpointError(f"{path}: the sizes give parameter '{name}' the empty shape {list(param.shape)}")


def check_block_count(path: Path, cfg: Any, blocks: Blocks, names: Iterable[str]) -> None:
    """The config asks for no more blocks than the weights hold (the distinct indices after their prefix): the module
    is built block by block before its tensor names are compared, and a count of 10**9 would exhaust the memory."""
    value = getattr(cfg, blocks.field)
    count = len(value) if isinstance(value, tuple) else value
    pattern = re.compile(re.escape(blocks.prefix) + r"(\d+)\.")
    held = len({match[1] for match in map(pattern.match, names) if match})
    if count > held:
        shown = f"has {count} items" if isinstance(value, tuple) else f"is {count}"
        raise CheckpointError(
            f"{path}: {blocks.key} {shown}, expected at most {held}, the blocks ('{blocks.prefix}N.*') the weights in "
            f"{path.parent} hold"
        )


def all_finite(module: nn.Module) -> bool:
    """No parameter holds NaN or inf: each one's min and max stay on the device, read back in one host sync."""
    extremes = [torch.stack(torch.aminmax(param)).float() for param in module.parameters()]
    return bool(torch.isfinite(torch.stack(extremes)).all())


def nonfinite_error(module: nn.Module, sources: dict[str, ParamSource], reader: TensorReader) -> CheckpointError:
    """The error naming the first checkpoint tensor that holds NaN or inf in its parameter's dtype (looked for only
    once the load has seen one, so a clean load pays no sync per tensor)."""
    for param_name, param in module.named_parameters():
        if torch.isfinite(param).all():
            continue
        keys = tensors_of(sources[param_name], reader)
        for key, shape in keys:
            if not torch.isfinite(reader.read(key, shape).to(param.dtype)).all():
                dtype = str(param.dtype).removeprefix("torch.")
                return CheckpointError(f"tensor '{key}' in {reader.files[key]} holds NaN or infinite values (as {dtype})")
        # Each finite on its own: a weight norm's fold divided by a zero direction.
        names = [key for key, _ in keys]
        return CheckpointError(f"tensors {names} in {reader.folder} give parameter '{param_name}' NaN or infinite values")
    raise AssertionError("no parameter holds NaN or inf")

