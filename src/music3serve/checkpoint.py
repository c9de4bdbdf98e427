"""Load MiniMaxAI/MiniMax-Music3 from its diffusers layout straight into our modules, strictly: one component
(load_component) or all of them with the tokenizer (load_models)."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tokenizers import Tokenizer
from torch import nn
from tqdm.auto import tqdm

from .checkpoint_checks import all_finite, check_block_count, check_fit, check_layout, check_nonempty, nonfinite_error
from .checkpoint_config import config_values
from .checkpoint_layout import COMPONENTS, component_folder, load_config
from .checkpoint_reader import TensorReader, fill_parameter, first_names, source_keys, tensors_of, weight_files
from .errors import CheckpointError, Music3Error
from .models.condition_encoder import ConditionEncoder
from .models.depth_decoder import DepthDecoder
from .models.dit import DiT
from .models.language_model import LanguageModel
from .models.vocoder import Vocoder
from .talker.quantize import quantize_talker
from .tokenizer import load_tokenizer

ACOUSTIC = ("condition_encoder", "dit", "vocoder")  # stage 1's components


@dataclass
class Music3Models:
    tokenizer: Tokenizer
    language_model: LanguageModel
    depth_decoder: DepthDecoder
    condition_encoder: ConditionEncoder
    dit: DiT | None  # None where stage 1 runs in another process
    vocoder: Vocoder | None


@contextmanager
def access_errors() -> Iterator[None]:
    """An OSError from looking at the checkpoint's files (a folder that cannot be entered: Python 3.11's Path.is_file
    passes EACCES through) becomes a CheckpointError naming the path."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"cannot access {exc.filename or 'the checkpoint'}: {exc.strerror or exc}") from exc


@access_errors()
def load_component(
    root: Path, name: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, progress: bool = False
) -> nn.Module:
    """Build our module for one component and fill it from disk, tensor by tensor, on `device` in `dtype` (progress:
    a bar of the bytes filled)."""
    component = COMPONENTS[name]
    folder = component_folder(root, name)
    cfg = load_config(root, name)
    files = weight_files(folder, component.weights)
    if component.blocks:
        check_block_count(folder / "config.json", cfg, component.blocks, files)
    with config_values(folder / "config.json"), torch.device("meta"):
        module = component.model(cfg)
        sources = component.model.checkpoint_sources(cfg)
    check_nonempty(module, folder / "config.json")
    params = {param_name for param_name, _ in module.named_parameters()}
    assert set(sources) == params, f"{name}: sources and parameters differ: {set(sources) ^ params}"
    wanted = set().union(*(source_keys(s, set(files)) for s in sources.values()))
    unexpected = sorted(set(files) - wanted)
    if unexpected:
        raise CheckpointError(f"unexpected tensors in {folder}: {first_names(unexpected)}")
    with ExitStack() as stack:
        reader = TensorReader(folder, files, stack)
        for source in sources.values():  # every name, shape and dtype, before the module takes its memory
            for key, shape in tensors_of(source, reader):
                reader.view(key, shape)
        module = module.to(dtype or component.disk_dtype).to_empty(device=device)
        size = sum(param.numel() * param.element_size() for param in module.parameters())
        with tqdm(total=size, desc=f"loading {name}", unit="B", unit_scale=True, disable=not progress) as bar:
            for param_name, param in module.named_parameters():
                fill_parameter(param, sources[param_name], reader)
                bar.update(param.numel() * param.element_size())
        if not all_finite(module):
            raise nonfinite_error(module, sources, reader)
    return module.eval().requires_grad_(False)


def require_device(device: torch.device | str | None) -> None:
    """A CUDA device must be one torch can see: said plainly before any weight is read."""
    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise Music3Error(f"device {str(device)!r} was asked for, but torch sees no CUDA device (a CPU build of torch, "
                          "or no GPU visible): use device 'cpu' or a CUDA build of torch")


@access_errors()
def load_models(
    root: Path,
    device: torch.device | str = "cpu",
    talker_dtype: torch.dtype | None = None,
    acoustic: bool = True,
    progress: bool = False,
    quantization: str = "none",
) -> Music3Models:
    """Every component on `device`; the talker in bf16 on CUDA (float32 on the CPU) unless told otherwise, the
    acoustic components in float32 (a precision policy casts them, keeping its float32 islands true). With
    acoustic=False the DiT and vocoder stay on disk (stage 1 runs in another process). progress: a bar per component.
    quantization "fp8": the talker's weights turned to e4m3 as soon as they are read (talker/quantize.py), before
    stage 1's load, so its bf16 copy and stage 1's float32 one never share the device."""
    require_device(device)
    root = Path(root)
    check_layout(root)
    check_fit(root)
    if talker_dtype is None:
        talker_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32

    def load(name: str, dtype: torch.dtype) -> nn.Module:
        return load_component(root, name, device, dtype, progress)

    if quantization not in ("none", "fp8"):
        raise Music3Error(f"quantization must be none or fp8, got {quantization!r}")
    language_model, depth_decoder = load("language_model", talker_dtype), load("depth_decoder", talker_dtype)
    if quantization == "fp8":
        quantize_talker(language_model, depth_decoder)
    return Music3Models(
        tokenizer=load_tokenizer(root / "tokenizer"),
        language_model=language_model,
        depth_decoder=depth_decoder,
        condition_encoder=load("condition_encoder", torch.float32),
        dit=load("dit", torch.float32) if acoustic else None,
        vocoder=load("vocoder", torch.float32) if acoustic else None,
    )
