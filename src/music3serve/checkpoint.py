"""Read the diffusers layout of MiniMaxAI/MiniMax-Music3 straight into our modules, strictly."""

from __future__ import annotations

import math
import re
import typing
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer
from torch import nn
from tqdm.auto import tqdm

from . import contract
from .checkpoint_config import SUPPORTED, check_supported, checked_fields, config_values, read_json
from .errors import CheckpointError, Music3Error
from .tokenizer import load_tokenizer
from .models.condition_encoder import ConditionEncoder, ConditionEncoderConfig
from .models.depth_decoder import DepthDecoder, DepthDecoderConfig
from .models.dit import DiT, DiTConfig
from .models.language_model import LanguageModel, LanguageModelConfig
from .models.vocoder import Vocoder, VocoderConfig
from .models.weights import ParamSource, WeightNormSource
from .talker.quantize import quantize_talker


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


@contextmanager
def access_errors() -> Iterator[None]:
    """An OSError from looking at the checkpoint's files (a folder that cannot be entered: Python 3.11's Path.is_file
    passes EACCES through) becomes a CheckpointError naming the path."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"cannot access {exc.filename or 'the checkpoint'}: {exc.strerror or exc}") from exc


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
            return checked_fields(COMPONENTS[name].config(raw))
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc


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


class _TensorReader:
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


def _fill(param: torch.Tensor, source: ParamSource, reader: _TensorReader) -> None:
    with torch.no_grad():
        if isinstance(source, WeightNormSource):
            (g_key, g_shape), (v_key, v_shape) = _tensors_of(source, reader)
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


def _tensors_of(source: ParamSource, reader: _TensorReader) -> list[tuple[str, tuple[int, ...]]]:
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


def nonfinite_error(module: nn.Module, sources: dict[str, ParamSource], reader: _TensorReader) -> CheckpointError:
    """The error naming the first checkpoint tensor that holds NaN or inf in its parameter's dtype (looked for only
    once the load has seen one, so a clean load pays no sync per tensor)."""
    for param_name, param in module.named_parameters():
        if torch.isfinite(param).all():
            continue
        keys = _tensors_of(sources[param_name], reader)
        for key, shape in keys:
            if not torch.isfinite(reader.read(key, shape).to(param.dtype)).all():
                dtype = str(param.dtype).removeprefix("torch.")
                return CheckpointError(f"tensor '{key}' in {reader.files[key]} holds NaN or infinite values (as {dtype})")
        # Each finite on its own: a weight norm's fold divided by a zero direction.
        names = [key for key, _ in keys]
        return CheckpointError(f"tensors {names} in {reader.folder} give parameter '{param_name}' NaN or infinite values")
    raise AssertionError("no parameter holds NaN or inf")


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
        reader = _TensorReader(folder, files, stack)
        for source in sources.values():  # every name, shape and dtype, before the module takes its memory
            for key, shape in _tensors_of(source, reader):
                reader.view(key, shape)
        module = module.to(dtype or component.disk_dtype).to_empty(device=device)
        size = sum(param.numel() * param.element_size() for param in module.parameters())
        with tqdm(total=size, desc=f"loading {name}", unit="B", unit_scale=True, disable=not progress) as bar:
            for param_name, param in module.named_parameters():
                _fill(param, sources[param_name], reader)
                bar.update(param.numel() * param.element_size())
        if not all_finite(module):
            raise nonfinite_error(module, sources, reader)
    return module.eval().requires_grad_(False)


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


PIPELINE_CLASS = "MiniMaxMusic3ModularPipeline"
ACOUSTIC = ("condition_encoder", "dit", "vocoder")  # stage 1's components


@dataclass
class Music3Models:
    tokenizer: Tokenizer
    language_model: LanguageModel
    depth_decoder: DepthDecoder
    condition_encoder: ConditionEncoder
    dit: DiT | None  # None where stage 1 runs in another process
    vocoder: Vocoder | None


def check_layout(root: Path) -> None:
    """The pipeline index and scheduler say this is a MiniMax-Music3 checkpoint with its fixed schedule."""
    if not Path(root).is_dir():
        what = "is not a folder" if Path(root).exists() else "does not exist"
        raise CheckpointError(f"model folder {root} {what}")
    index = read_json(Path(root) / "modular_model_index.json")
    if index.get("_class_name") != PIPELINE_CLASS:
        raise CheckpointError(f"{root}/modular_model_index.json is not a {PIPELINE_CLASS} (got {index.get('_class_name')!r})")
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
            raise CheckpointError(f"{component_folder(root, name) / 'config.json'}: {key} is {found!r}, expected {expected}")


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
