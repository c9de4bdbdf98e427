"""The diffusers layout both ways (ours <-> diffusers/transformers), strict loading errors, and streaming loads."""

from __future__ import annotations

import errno
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from music3serve import checkpoint, checkpoint_checks, checkpoint_config, checkpoint_layout, checkpoint_reader, contract
from music3serve.checkpoint import load_component
from music3serve.checkpoint_layout import COMPONENTS
from music3serve.errors import CheckpointError
from music3serve.models.language_model import KVCache
from music3serve.tiny import TINY_CONFIGS, random_tensor

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

REFERENCE_CLASSES = {
    "depth_decoder": diffusers.MiniMaxMusic3RVQDepthDecoder,
    "condition_encoder": diffusers.MiniMaxMusic3ConditionEncoder,
    "dit": diffusers.MiniMaxMusic3Transformer1DModel,
    "vocoder": diffusers.MiniMaxMusic3Vocoder,
}
LEGAL_ROWS = [contract.AUDIO_END] + list(
    range(contract.AUDIO_CODE_OFFSET, contract.AUDIO_CODE_OFFSET + contract.SEMANTIC_CODES)
)


def positions(embeds: torch.Tensor, start: int) -> torch.Tensor:
    """Positions start, start + 1, ... of a [rows, t, hidden] input."""
    return torch.arange(start, start + embeds.shape[1])


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a component folder, whatever the sharding."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def load_reference(root: Path, name: str) -> torch.nn.Module:
    folder = COMPONENTS[name].folder
    if name == "language_model":
        return transformers.Qwen3ForCausalLM.from_pretrained(root / folder, dtype=torch.float32).eval()
    return REFERENCE_CLASSES[name].from_pretrained(root, subfolder=folder, dtype=torch.float32).eval()


# ---------------------------------------------------------------------------------------------------------------
# Our tiny checkpoint in diffusers / transformers


@pytest.mark.parametrize("name", list(COMPONENTS))
def test_tiny_component_loads_in_reference(tiny_dir: Path, name: str) -> None:
    """Each folder loads with the reference class, and every tensor on disk lands in it unchanged (none missing)."""
    reference = load_reference(tiny_dir, name)
    on_disk = file_tensors(tiny_dir / COMPONENTS[name].folder)
    state = reference.state_dict()
    assert set(state) == set(on_disk)
    for key, tensor in on_disk.items():
        assert torch.equal(state[key], tensor.float()), key


def test_tiny_layout_matches_the_released_one(tiny_dir: Path) -> None:
    """Shard counts, index files and on-disk dtypes mirror MiniMaxAI/MiniMax-Music3."""
    for name, component in COMPONENTS.items():
        folder = tiny_dir / component.folder
        shards = sorted(folder.glob("*.safetensors"))
        assert len(shards) == component.shards, name
        index = folder / f"{component.weights}.safetensors.index.json"
        assert index.is_file() == (component.shards > 1), name
        if index.is_file():
            assert set(json.loads(index.read_text())["weight_map"].values()) == {p.name for p in shards}
        assert {t.dtype for t in file_tensors(folder).values()} == {component.disk_dtype}, name
    assert (tiny_dir / "scheduler" / "scheduler_config.json").is_file()
    assert (tiny_dir / "tokenizer" / "tokenizer.json").is_file()


def test_tiny_checkpoint_takes_config_overrides(tmp_path: Path) -> None:
    """The GPU precision tests' wider talker: overridden values reach the config, the tensors and our loader."""
    from music3serve.tiny import write_tiny_checkpoint

    root = write_tiny_checkpoint(tmp_path / "wide", overrides={"depth_decoder": {"hidden_size": 96, "num_layers": 3}})
    depth = load_component(root, "depth_decoder")
    assert (depth.cfg.hidden, len(depth.blocks)) == (96, 3)
    assert load_component(root, "language_model").cfg.hidden == TINY_CONFIGS["language_model"]["hidden_size"]
    with pytest.raises(ValueError, match=r"unknown components \['depth'\]"):
        write_tiny_checkpoint(tmp_path / "bad", overrides={"depth": {"hidden_size": 96}})


@pytest.fixture(scope="module")
def tiny_pipeline(tiny_dir: Path):
    """The whole checkpoint through the diffusers modular pipeline's own loader (modular_model_index.json)."""
    from diffusers.modular_pipelines import ModularPipeline

    pipeline = ModularPipeline.from_pretrained(str(tiny_dir))
    pipeline.load_components(dtype=torch.float32)
    return pipeline


def test_tiny_checkpoint_loads_as_modular_pipeline(tiny_dir: Path, tiny_pipeline) -> None:
    from diffusers.modular_pipelines import MiniMaxMusic3Blocks, MiniMaxMusic3ModularPipeline

    assert isinstance(tiny_pipeline, MiniMaxMusic3ModularPipeline)
    assert isinstance(tiny_pipeline.blocks, MiniMaxMusic3Blocks)
    expected = {
        "tokenizer": transformers.Qwen2Tokenizer,
        "language_model": transformers.Qwen3ForCausalLM,
        "rvq_depth_decoder": diffusers.MiniMaxMusic3RVQDepthDecoder,
        "condition_encoder": diffusers.MiniMaxMusic3ConditionEncoder,
        "transformer": diffusers.MiniMaxMusic3Transformer1DModel,
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler,
        "vocoder": diffusers.MiniMaxMusic3Vocoder,
    }
    for attribute, cls in expected.items():
        assert isinstance(getattr(tiny_pipeline, attribute, None), cls), attribute
    assert tiny_pipeline.guider is not None  # created from its default config, not from the checkpoint
    # Weights come from our files, not from a random init.
    transformer_state = tiny_pipeline.transformer.state_dict()
    for key, tensor in file_tensors(tiny_dir / "transformer").items():
        assert torch.equal(transformer_state[key], tensor), key
    assert torch.equal(
        tiny_pipeline.language_model.lm_head.weight,
        file_tensors(tiny_dir / "language_model")["lm_head.weight"].float(),
    )
    assert tiny_pipeline.scheduler.config.invert_sigmas is True
    assert tiny_pipeline.sampling_rate == contract.SAMPLE_RATE
    assert tiny_pipeline.latent_hop_length == contract.LATENT_HOP
    assert tiny_pipeline.frame_rate == contract.FRAME_RATE


def test_modular_index_matches_what_diffusers_writes(tiny_dir: Path, tiny_pipeline, tmp_path: Path) -> None:
    """Our modular_model_index.json has the keys and component entries of diffusers' own save_pretrained."""
    tiny_pipeline.save_pretrained(str(tmp_path / "saved"), overwrite_modular_index=True)
    ours = json.loads((tiny_dir / "modular_model_index.json").read_text())
    theirs = json.loads((tmp_path / "saved" / "modular_model_index.json").read_text())
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if key.startswith("_"):
            assert ours[key] == value, key
            continue
        library, cls, spec = value
        assert ours[key][:2] == [library, cls], key
        assert set(ours[key][2]) == set(spec), key
        assert ours[key][2]["subfolder"] == spec["subfolder"] == key
        assert ours[key][2]["type_hint"] == spec["type_hint"], key
    # Every folder diffusers writes for a component exists in ours and holds the same file names.
    for key in (k for k in theirs if not k.startswith("_")):
        saved = {p.name for p in (tmp_path / "saved" / key).iterdir()} - {"generation_config.json"}
        ours_files = {p.name for p in (tiny_dir / key).iterdir()}
        if key in ("language_model", "transformer"):  # ours are sharded like the release
            saved = {n for n in saved if not n.endswith(".safetensors")}
        assert saved <= ours_files, (key, saved - ours_files)


# ---------------------------------------------------------------------------------------------------------------
# A checkpoint written by diffusers' / transformers' save_pretrained, loaded in ours


def _perturb(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Move every parameter off its init (norm weights of 1, zero biases, ...) so a mis-mapped tensor shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=gen) * param.abs().mean().clamp_min(0.1))
    return module.eval()


@pytest.fixture(scope="module")
def saved_by_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.nn.Module]]:
    """Reference modules with tiny configs in random init, written with their own save_pretrained (sharded)."""
    root = tmp_path_factory.mktemp("saved_by_reference")
    torch.manual_seed(1)
    lm_config = transformers.Qwen3Config(
        vocab_size=contract.AUDIO_CODE_OFFSET + contract.SEMANTIC_CODES + 5,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=contract.MAX_CONTEXT,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    )
    modules: dict[str, torch.nn.Module] = {
        "language_model": transformers.Qwen3ForCausalLM(lm_config),
        "depth_decoder": diffusers.MiniMaxMusic3RVQDepthDecoder(
            hidden_size=32, num_layers=2, num_attention_heads=2, intermediate_size=48
        ),
        "condition_encoder": diffusers.MiniMaxMusic3ConditionEncoder(condition_hidden_dim=32, out_dim=16),
        "dit": diffusers.MiniMaxMusic3Transformer1DModel(
            condition_dim=16, num_layers=3, num_attention_heads=2, attention_head_dim=8, ff_inner_dim=32,
            rotary_dim=4, fourier_embedding_dim=8,
        ),
        "vocoder": diffusers.MiniMaxMusic3Vocoder(decoder_input_dim=16, decoder_hidden_dim=32, upsampling_ratios=(4, 2)),
    }
    for seed, (name, module) in enumerate(modules.items()):
        _perturb(module.float(), seed)
        folder = root / COMPONENTS[name].folder
        if name == "language_model":
            module.save_pretrained(folder, max_shard_size="8MB")  # embed and lm_head alone exceed it
        elif name == "dit":
            module.save_pretrained(folder, max_shard_size="40KB")
        else:
            module.save_pretrained(folder)
    return root, modules


def test_reference_save_is_sharded(saved_by_reference) -> None:
    root, _ = saved_by_reference
    lm_shards = list((root / "language_model").glob("model-*-of-*.safetensors"))
    dit_shards = list((root / "transformer").glob("diffusion_pytorch_model-*-of-*.safetensors"))
    assert len(lm_shards) >= 3 and (root / "language_model" / "model.safetensors.index.json").is_file()
    assert len(dit_shards) >= 2
    assert (root / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()


@torch.no_grad()
def test_reference_saved_language_model_loads_in_ours(saved_by_reference) -> None:
    root, modules = saved_by_reference
    reference = modules["language_model"]
    ours = load_component(root, "language_model", "cpu", torch.float32)
    ids = torch.randint(0, reference.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    cache = KVCache.allocate(ours.cfg, 2, 16, torch.float32, torch.device("cpu"))
    hidden = ours(ours.embed(ids), positions(ours.embed(ids), 0), cache.at(0))
    ref_hidden = reference.model(input_ids=ids).last_hidden_state
    assert rel_err(hidden, ref_hidden) <= 1e-5
    assert rel_err(ours.logits(hidden), reference.lm_head(ref_hidden)[..., LEGAL_ROWS].float()) <= 1e-5


@torch.no_grad()
def test_reference_saved_small_components_load_in_ours(saved_by_reference) -> None:
    root, modules = saved_by_reference
    gen = torch.Generator().manual_seed(0)

    depth = load_component(root, "depth_decoder", "cpu", torch.float32)
    ref = modules["depth_decoder"]
    x = torch.randn(2, 8, 32, generator=gen)
    hidden = depth(depth.projection(x))
    ref_hidden = ref(ref.projection(x))
    assert rel_err(hidden, ref_hidden) <= 1e-5
    for codebook in range(1, 8):
        assert rel_err(depth.head_logits(hidden[:, -1], codebook), ref.audio_heads[codebook - 1](ref_hidden[:, -1])) <= 1e-5

    encoder = load_component(root, "condition_encoder", "cpu", torch.float32)
    frames = torch.randn(2, 9, 8 * 32, generator=gen)
    assert rel_err(encoder(frames), modules["condition_encoder"](frames)) <= 1e-5

    dit = load_component(root, "dit", "cpu", torch.float32)
    latents, t = torch.randn(2, 128, 11, generator=gen), torch.tensor([0.25, 0.75])
    condition = torch.randn(2, 11, 16, generator=gen)
    assert rel_err(dit(latents, t, condition), modules["dit"](latents, t, condition, return_dict=False)[0]) <= 1e-5

    vocoder = load_component(root, "vocoder", "cpu", torch.float32)
    latents = torch.randn(1, 128, 5, generator=gen)
    assert rel_err(vocoder(latents), modules["vocoder"](latents)) <= 1e-5


# ---------------------------------------------------------------------------------------------------------------
# Strictness: each damage is a CheckpointError naming the file or folder, and the tensor where there is one


def copy_component(tiny_dir: Path, tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A private copy of one component folder (load_component needs nothing else); returns (root, folder)."""
    root = tmp_path / "checkpoint"
    folder = root / COMPONENTS[name].folder
    shutil.copytree(tiny_dir / COMPONENTS[name].folder, folder)
    return root, folder


def rewrite(path: Path, edit) -> None:
    tensors = load_file(path)
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    edit(tensors)
    save_file(tensors, path, metadata=metadata)


def expect_error(root: Path, name: str, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_component(root, name, "cpu", torch.float32)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_missing_component_folder(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    expect_error(root, "vocoder", str(root / "vocoder"))


def test_missing_config(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    (folder / "config.json").unlink()
    expect_error(root, "dit", str(folder / "config.json"))


def test_broken_config(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "depth_decoder")
    config = json.loads((folder / "config.json").read_text())
    del config["num_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    expect_error(root, "depth_decoder", str(folder / "config.json"), "num_layers")
    (folder / "config.json").write_text("{not json")
    expect_error(root, "depth_decoder", str(folder / "config.json"))
    (folder / "config.json").write_text("[]")  # JSON, but not an object
    expect_error(root, "depth_decoder", f"{folder / 'config.json'} does not hold a JSON object")


@pytest.mark.parametrize("name,key,value,fragment", [
    ("dit", "in_channels", "128", "'in_channels' must be a positive int"),
    ("depth_decoder", "num_layers", [4], "'num_layers' must be a positive int"),
    ("vocoder", "upsampling_ratios", 8, "wrong type"),  # not a list: fails as the config is built
    ("dit", "rotary_dim", "8", "'rotary_dim' must be a positive int"),  # used only when a window renders
    ("dit", "fourier_embedding_dim", 0, "'fourier_embedding_dim' must be a positive int"),
    ("language_model", "rms_norm_eps", -1e-6, "'rms_norm_eps' must be a positive float"),
    ("depth_decoder", "num_attention_heads", True, "'num_attention_heads' must be a positive int"),
    ("language_model", "rms_norm_eps", float("inf"), "'rms_norm_eps' must be a positive float, got Infinity"),  # outputs all 0
    ("language_model", "rope_theta", float("inf"), "'rope_theta' must be a positive float, got Infinity"),
    ("language_model", "rope_theta", True, "'rope_theta' must be a positive float, got true"),  # loaded as 1.0
    ("language_model", "rope_theta", "1e6", '\'rope_theta\' must be a positive float, got "1e6"'),  # was accepted
    ("language_model", "rms_norm_eps", "1e-6", '\'rms_norm_eps\' must be a positive float, got "1e-6"'),
    ("language_model", "rope_parameters", ["default"], "'rope_parameters' must be a JSON object"),
    ("vocoder", "upsampling_ratios", [8, 0], "'upsampling_ratios' must be a non-empty list of positive ints"),
    ("vocoder", "upsampling_ratios", [], "'upsampling_ratios' must be a non-empty list of positive ints, got []"),
    # Values that name another architecture or change the math we run (these all loaded, and generated, silently).
    ("language_model", "hidden_act", "gelu", 'hidden_act is "gelu", we support only "silu"'),
    ("language_model", "attention_bias", True, "attention_bias is true, we support only false"),
    ("language_model", "tie_word_embeddings", True, "tie_word_embeddings is true, we support only false"),
    ("language_model", "use_sliding_window", True, "use_sliding_window is true, we support only false"),
    ("language_model", "layer_types", ["full_attention", "sliding_attention"],
     'layer_types is ["full_attention", "sliding_attention"], we support only "full_attention" (each item)'),
    ("language_model", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
     'rope_scaling.rope_type is "yarn", we support only "default"'),
    ("language_model", "rope_scaling", {"type": "linear", "factor": 2.0}, 'rope_scaling.type is "linear"'),
    ("language_model", "rope_scaling", "yarn", '\'rope_scaling\' must be a JSON object, got "yarn"'),
    ("language_model", "rope_parameters", {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0},
     'rope_parameters.rope_type is "llama3"'),
    ("language_model", "model_type", "llama", 'model_type is "llama", we support only "qwen3"'),
    ("language_model", "model_type", ["qwen3"], 'model_type is ["qwen3"], we support only "qwen3"'),  # not a list
    ("language_model", "architectures", ["LlamaForCausalLM"], 'architectures is ["LlamaForCausalLM"]'),
    ("language_model", "quantization_config", {"quant_method": "bitsandbytes"}, "quantization_config is {"),
    ("language_model", "torch_dtype", "int8", 'torch_dtype is "int8", we support only "bfloat16" or'),
    ("language_model", "attention_bias", 0, "attention_bias is 0"),  # a number is no bool
    ("dit", "_class_name", "Foo", '_class_name is "Foo", we support only "MiniMaxMusic3Transformer1DModel"'),
    ("vocoder", "_class_name", "MiniMaxMusic3Transformer1DModel", 'we support only "MiniMaxMusic3Vocoder"'),
    ("depth_decoder", "_class_name", None, "_class_name is null"),
    ("condition_encoder", "_class_name", "MiniMaxMusic3Vocoder", 'we support only "MiniMaxMusic3ConditionEncoder"'),
])
def test_a_config_value_is_checked_at_load(tiny_dir: Path, tmp_path: Path, name: str, key: str, value, fragment: str) -> None:
    """Every field of a component's config is a positive value of its type once loaded, also those the model reads
    only when it generates: a bad one fails the load, naming the file and the field."""
    root, folder = copy_component(tiny_dir, tmp_path, name)
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    expect_error(root, name, str(folder / "config.json"), fragment)


DELETE = object()


@pytest.mark.parametrize("name,key,value", [
    ("language_model", "torch_dtype", "float16"),  # a hint of the stored dtype only: each tensor says its own
    ("language_model", "torch_dtype", DELETE),
    ("language_model", "dtype", "float32"),  # what transformers v5 writes
    ("language_model", "rope_scaling", {"rope_type": "default"}),
    ("language_model", "rope_parameters", {"rope_type": "default", "rope_theta": 1e6}),
    ("language_model", "rope_theta", 1_000_000),  # an int stands for its float, as for rms_norm_eps
    ("language_model", "layer_types", ["full_attention", "full_attention"]),
    ("language_model", "hidden_act", DELETE),  # a missing key means the library default, which is what we run
    ("language_model", "model_type", DELETE),
    ("language_model", "architectures", DELETE),
    ("language_model", "tie_word_embeddings", DELETE),
    ("dit", "_class_name", DELETE),
])
def test_a_supported_config_value_loads(tiny_dir: Path, tmp_path: Path, name: str, key: str, value) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, name)
    config = json.loads((folder / "config.json").read_text())
    if value is DELETE:
        del config[key]
    else:
        config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    load_component(root, name, "cpu", torch.float32)


def tiny_with_json(tiny_dir: Path, tmp_path: Path, relative: str, **changes) -> Path:
    """The tiny checkpoint (linked) with the JSON file at `relative` (say "scheduler/scheduler_config.json") changed
    (a value DELETE: the key removed)."""
    root = copy = tmp_path / "checkpoint"
    original = tiny_dir
    copy.mkdir(parents=True)
    for part in Path(relative).parts:
        for entry in original.iterdir():
            if entry.name != part:
                (copy / entry.name).symlink_to(entry)
        original, copy = original / part, copy / part
        if original.is_dir():
            copy.mkdir()
    config = {**json.loads(original.read_text()), **changes}
    copy.write_text(json.dumps({key: value for key, value in config.items() if value is not DELETE}))
    return root


@pytest.mark.parametrize("key,value,fragment", [
    ("_class_name", "DDIMScheduler",
     '_class_name is "DDIMScheduler", we support only "FlowMatchEulerDiscreteScheduler"'),
    ("shift", 3.0, "shift is 3.0, we support only 1.0"),
    ("num_train_timesteps", 1000, "num_train_timesteps is 1000, we support only 1"),
    ("num_train_timesteps", True, "num_train_timesteps is true"),
    ("num_train_timesteps", DELETE, "num_train_timesteps is absent (read as 1000), we support only 1"),
    ("invert_sigmas", DELETE, "invert_sigmas is absent (read as false), we support only true"),
    ("use_karras_sigmas", True, "use_karras_sigmas is true"),
    ("use_dynamic_shifting", True, "use_dynamic_shifting is true"),
    ("shift_terminal", 0.1, "shift_terminal is 0.1, we support only null"),
    ("stochastic_sampling", True, "stochastic_sampling is true"),
])
def test_a_scheduler_value_we_do_not_run(tiny_dir: Path, tmp_path: Path, key: str, value, fragment: str) -> None:
    root = tiny_with_json(tiny_dir, tmp_path, "scheduler/scheduler_config.json", **{key: value})
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_models(root, "cpu")
    assert fragment in str(info.value) and str(root / "scheduler" / "scheduler_config.json") in str(info.value)


@pytest.mark.parametrize("text", ['{"hidden_size": 1' + "0" * 5000 + "}", "[" * 200_000 + "]" * 200_000])
def test_config_json_past_the_parser_limits(tiny_dir: Path, tmp_path: Path, text: str) -> None:
    """An integer of 5000 digits (ValueError) or 200k levels of nesting (RecursionError) fail naming the file."""
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    (folder / "config.json").write_text(text)
    expect_error(root, "dit", f"cannot read {folder / 'config.json'}")


def test_configs_as_tiny_and_diffusers_write_them_pass(tiny_dir: Path, saved_by_reference, tmp_path: Path) -> None:
    """The checks refuse nothing the released layout (mirrored by tiny.py) or diffusers' / transformers' own
    save_pretrained write, with every key they add (architectures, dtype, layer_types, rope_parameters, the
    scheduler's options)."""
    checkpoint_checks.check_layout(tiny_dir)
    checkpoint_checks.check_fit(tiny_dir)
    root, _ = saved_by_reference
    lm = json.loads((root / "language_model" / "config.json").read_text())
    assert {"architectures", "layer_types", "rope_parameters", "model_type"} <= set(lm), sorted(lm)
    for name in COMPONENTS:
        checkpoint_layout.load_config(root, name)
    diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, invert_sigmas=True).save_pretrained(tmp_path)
    saved = tmp_path / "scheduler_config.json"
    assert "use_karras_sigmas" in json.loads(saved.read_text())
    checkpoint_config.check_supported(saved, json.loads(saved.read_text()), checkpoint_config.SUPPORTED["scheduler"])


def test_missing_weights(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "condition_encoder")
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    expect_error(root, "condition_encoder", str(folder), "diffusion_pytorch_model.safetensors")


def test_weights_without_tensors(tiny_dir: Path, tmp_path: Path) -> None:
    """An empty weight map or a single file of no tensors fail by name (both raised a raw IndexError)."""
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    expect_error(root, "dit", f"{index} lists no tensors")
    root, folder = copy_component(tiny_dir, tmp_path / "single", "vocoder")
    save_file({}, folder / "diffusion_pytorch_model.safetensors")
    expect_error(root, "vocoder", f"{folder / 'diffusion_pytorch_model.safetensors'} holds no tensors")


def test_unreadable_weight_file(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight file that exists but cannot be opened reports why (safetensors said "No such file or directory");
    opening is patched to fail, as tests may run as root, where chmod 000 does not keep a file from being read."""
    root, folder = copy_component(tiny_dir, tmp_path, "vocoder")
    path = folder / "diffusion_pytorch_model.safetensors"
    original = Path.open

    def locked_open(self: Path, *args, **kwargs):
        if self == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", locked_open)
    message = expect_error(root, "vocoder", f"cannot read {path}: Permission denied")
    assert "No such file" not in message


@pytest.mark.parametrize("locked", ["", "transformer", "tokenizer", "scheduler"])
def test_folder_that_cannot_be_entered(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, locked: str) -> None:
    """A folder of mode 000 (the root or one inside it): a CheckpointError naming the path, not the raw
    PermissionError that Path.is_file passes through. Path.stat is patched to fail as it would there, since tests may
    run as root, whom permissions do not stop."""
    folder = tiny_dir / locked if locked else tiny_dir
    original = Path.stat

    def stat(self: Path, *, follow_symlinks: bool = True):
        if folder in self.parents:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return original(self, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(Path, "stat", stat)
    with pytest.raises(CheckpointError, match=f"cannot access {folder}/.*: Permission denied"):
        checkpoint.load_models(tiny_dir, "cpu")


def test_missing_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "condition_encoder")
    rewrite(folder / "diffusion_pytorch_model.safetensors", lambda t: t.pop("proj.bias"))
    expect_error(root, "condition_encoder", str(folder), "'proj.bias'")


def test_missing_weight_norm_tensors(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "vocoder")
    rewrite(folder / "diffusion_pytorch_model.safetensors", lambda t: t.pop("conv_out.weight_g"))
    expect_error(root, "vocoder", str(folder), "conv_out.weight_g")


def test_missing_tensor_from_index(tiny_dir: Path, tmp_path: Path) -> None:
    """The index no longer lists a tensor (its shard still holds it): still missing, never silently random."""
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["transformer_blocks.1.ff_out.bias"]
    index.write_text(json.dumps(data))
    expect_error(root, "dit", str(folder), "'transformer_blocks.1.ff_out.bias'")


def test_shard_holds_a_tensor_its_index_does_not_list(tiny_dir: Path, tmp_path: Path) -> None:
    """A tensor in a shard but not in the index (neither a missing nor an extra one) is refused, not ignored."""
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    shard = folder / "diffusion_pytorch_model-00002-of-00002.safetensors"
    rewrite(shard, lambda t: t.update({"pos_embed": torch.zeros(3)}))
    expect_error(root, "dit", f"{shard} holds tensors its index does not list: ['pos_embed']")


def test_shard_lacks_a_tensor_its_index_lists(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "language_model")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"]["model.norm.weight"]
    rewrite(shard, lambda t: t.pop("model.norm.weight"))
    expect_error(root, "language_model", str(shard), "'model.norm.weight'")


def test_unexpected_extra_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "depth_decoder")
    rewrite(
        folder / "diffusion_pytorch_model.safetensors",
        lambda t: t.update({"layers.9.attn.to_q.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}),
    )
    expect_error(root, "depth_decoder", str(folder), "layers.9.attn.to_q.weight")


def test_unexpected_extra_tensor_in_a_shard(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    shard = folder / "diffusion_pytorch_model-00002-of-00002.safetensors"
    rewrite(shard, lambda t: t.update({"pos_embed": torch.zeros(3)}))
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["pos_embed"] = shard.name
    index.write_text(json.dumps(data))
    expect_error(root, "dit", str(folder), "pos_embed")


@pytest.mark.parametrize(
    ("name", "key", "shape"),
    [
        ("condition_encoder", "proj.bias", (33,)),
        ("condition_encoder", "proj.weight", (32, 64, 1)),  # same rank, wrong kernel
        ("depth_decoder", "layers.0.attn.to_k.weight", (64 * 64,)),  # same element count, flattened
        ("vocoder", "blocks.1.conv_t1.weight_g", (4,)),
    ],
)
def test_misshaped_tensor(tiny_dir: Path, tmp_path: Path, name: str, key: str, shape: tuple[int, ...]) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, name)
    path = folder / "diffusion_pytorch_model.safetensors"
    rewrite(path, lambda t: t.update({key: torch.zeros(shape, dtype=t[key].dtype)}))
    expect_error(root, name, str(path), f"'{key}'", str(list(shape)))


def test_misshaped_language_model_head(tiny_dir: Path, tmp_path: Path) -> None:
    """lm_head is read by row ranges; a vocabulary that does not match config.json still fails by name."""
    root, folder = copy_component(tiny_dir, tmp_path, "language_model")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"]["lm_head.weight"]
    rewrite(shard, lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:-1].clone()}))
    expect_error(root, "language_model", str(shard), "'lm_head.weight'")


@pytest.mark.parametrize("hidden", [10**7, 10**12])
def test_config_sizes_far_beyond_the_weights(tiny_dir: Path, tmp_path: Path, hidden: int) -> None:
    """A config whose sizes do not match the weights fails on the shapes before the module takes its memory (hundreds
    of terabytes here: the allocation raised a raw RuntimeError, and on a GPU an out-of-memory error), and sizes too
    large to count fail naming the config."""
    root, folder = copy_component(tiny_dir, tmp_path, "depth_decoder")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": hidden}))
    expect_error(root, "depth_decoder", str(folder), str(hidden))


@pytest.mark.parametrize("name,key,value,fragment", [
    ("language_model", "num_hidden_layers", 10**9, "num_hidden_layers is 1000000000, expected at most 2"),
    ("depth_decoder", "num_layers", 10**9, "num_layers is 1000000000, expected at most 2"),
    ("dit", "num_layers", 10**9, "num_layers is 1000000000, expected at most 2, the blocks ('transformer_blocks.N.*')"),
    ("vocoder", "upsampling_ratios", [8, 8, 4, 2] + [1] * 10**6, "upsampling_ratios has 1000004 items, expected at most 4"),
])
def test_block_count_far_beyond_the_weights(tiny_dir: Path, tmp_path: Path, name: str, key: str, value, fragment: str) -> None:
    """A count of blocks the weights do not hold fails at once, naming the config: the module, built block by block
    on the meta device before the tensor names were compared, hung and exhausted the memory."""
    root, folder = copy_component(tiny_dir, tmp_path, name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    expect_error(root, name, str(folder / "config.json"), fragment)


def weights_with(tiny_dir: Path, tmp_path: Path, name: str, key: str, value: torch.Tensor) -> tuple[Path, Path]:
    """A copy of one component whose tensor `key` is replaced by `value`; returns (root, the file that holds it)."""
    root, folder = copy_component(tiny_dir, tmp_path, name)
    index = folder / f"{COMPONENTS[name].weights}.safetensors.index.json"
    file = json.loads(index.read_text())["weight_map"][key] if index.is_file() else f"{COMPONENTS[name].weights}.safetensors"
    rewrite(folder / file, lambda t: t.update({key: value.expand(t[key].shape).clone()}))
    return root, folder / file


@pytest.mark.parametrize("name,key,value,dtype,fragment", [
    ("vocoder", "conv_out.bias", torch.tensor([float("nan")]), torch.float32, "(as float32)"),  # FloatingPointError
    ("language_model", "model.norm.weight", torch.tensor([float("inf")], dtype=torch.bfloat16), None, "(as bfloat16)"),
    ("language_model", "lm_head.weight", torch.tensor([1e300], dtype=torch.float64), None, "(as bfloat16)"),  # cast
    ("dit", "transformer_blocks.1.ff_out.bias", torch.tensor([-float("inf")]), torch.float32, "(as float32)"),
    ("vocoder", "blocks.2.res_unit1.conv1.weight_v", torch.tensor([float("nan")]), torch.float32, "(as float32)"),
])
def test_nonfinite_weights(tiny_dir: Path, tmp_path: Path, name: str, key: str, value: torch.Tensor, dtype, fragment: str) -> None:
    """NaN or inf in a weight, on disk or once cast to the dtype we run in, fails naming the tensor and its file (it
    loaded silently, and failed only in the first song, if at all)."""
    root, path = weights_with(tiny_dir, tmp_path, name, key, value)
    with pytest.raises(CheckpointError) as info:
        load_component(root, name, "cpu", dtype)
    assert f"tensor '{key}' in {path} holds NaN or infinite values {fragment}" == str(info.value)


def test_weight_norm_folded_to_nan(tiny_dir: Path, tmp_path: Path) -> None:
    """Finite g and v whose fold is not (a zero direction) fail naming both."""
    root, _ = weights_with(tiny_dir, tmp_path, "vocoder", "conv_out.weight_v", torch.tensor([0.0]))
    expect_error(root, "vocoder", "['conv_out.weight_g', 'conv_out.weight_v']", "give parameter 'conv_out.weight' NaN")


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e4m3fn])
def test_tensor_of_a_wrong_dtype(tiny_dir: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    """Integers, booleans or (unscaled) fp8 where weights belong are refused by name, not cast into wrong weights."""
    root, folder = copy_component(tiny_dir, tmp_path, "condition_encoder")
    path = folder / "diffusion_pytorch_model.safetensors"
    rewrite(path, lambda t: t.update({"proj.weight": (t["proj.weight"] * 100).to(dtype)}))
    expect_error(root, "condition_encoder", str(path), "'proj.weight'", "floating-point")


@pytest.mark.parametrize("cut", ["data", "header", "empty"])
def test_truncated_safetensors(tiny_dir: Path, tmp_path: Path, cut: str) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    shard = folder / "diffusion_pytorch_model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes({"data": data[:-7], "header": data[:20], "empty": b""}[cut])
    expect_error(root, "dit", str(shard))


def test_corrupted_safetensors_header(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "vocoder")
    path = folder / "diffusion_pytorch_model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:24] = b"\xff" * 16
    path.write_bytes(bytes(data))
    expect_error(root, "vocoder", str(path))


def test_index_points_at_missing_shard(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "language_model")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.layers.1.self_attn.o_proj.weight"] = "model-00005-of-00004.safetensors"
    index.write_text(json.dumps(data))
    expect_error(
        root, "language_model", str(folder / "model-00005-of-00004.safetensors"), "model.layers.1.self_attn.o_proj.weight"
    )


def test_deleted_shard(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    shard = folder / "diffusion_pytorch_model-00002-of-00002.safetensors"
    on_shard = sorted(load_file(shard))
    shard.unlink()
    expect_error(root, "dit", str(shard), on_shard[0])


def test_broken_index(tiny_dir: Path, tmp_path: Path) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    expect_error(root, "dit", str(index), "weight_map")
    index.write_text("[1, 2")
    expect_error(root, "dit", str(index))


@pytest.mark.parametrize("file", [None, 2, ["diffusion_pytorch_model-00001-of-00002.safetensors"]])
def test_index_maps_a_tensor_to_something_not_a_file_name(tiny_dir: Path, tmp_path: Path, file) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["proj_in.weight"] = file
    index.write_text(json.dumps(data))
    expect_error(root, "dit", str(index), "'proj_in.weight'", "a file name")


@pytest.mark.parametrize("outside", ["../{}", "{root}/{}", "sub/{}"])
def test_index_maps_a_tensor_to_a_file_outside_its_folder(tiny_dir: Path, tmp_path: Path, outside: str) -> None:
    root, folder = copy_component(tiny_dir, tmp_path, "dit")
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = data["weight_map"]["proj_in.weight"]
    for copy in (folder.parent / name, folder / "sub" / name):  # a real shard there: the old code loaded it silently
        copy.parent.mkdir(exist_ok=True)
        shutil.copy(folder / name, copy)
    data["weight_map"]["proj_in.weight"] = outside.format(name, root=folder.parent)
    index.write_text(json.dumps(data))
    expect_error(root, "dit", str(index), "'proj_in.weight'", "a file name in")


def consistent_component(root: Path, name: str, **changes) -> Path:
    """Write one component folder under root: the tiny config with changes, random weights of the shapes it implies;
    returns root."""
    component = COMPONENTS[name]
    folder = root / component.folder
    folder.mkdir(parents=True)
    raw = {**TINY_CONFIGS[name], **changes}
    (folder / "config.json").write_text(json.dumps(raw))
    gen = torch.Generator().manual_seed(0)
    shapes = checkpoint_layout.checkpoint_tensors(name, component.config(raw))
    save_file({key: random_tensor(key, shape, gen) for key, shape in shapes.items()},
              folder / f"{component.weights}.safetensors")
    return folder.parent


def test_sizes_that_leave_a_parameter_empty(tmp_path: Path) -> None:
    """Widths halved to nothing (decoder_hidden_dim 8 over four upsampling ratios) fail by name; folding the weight
    norm of an empty conv used to kill the process with a floating point exception."""
    root = consistent_component(tmp_path / "checkpoint", "vocoder", decoder_hidden_dim=8)
    expect_error(root, "vocoder", str(root / "vocoder" / "config.json"), "'blocks.3.up.weight'", "[1, 0, 4]")


def checkpoint_with(tiny_dir: Path, tmp_path: Path, name: str, **changes) -> Path:
    """The tiny checkpoint (linked) with one component rewritten by consistent_component."""
    root = tmp_path / "checkpoint"
    root.mkdir()
    for entry in tiny_dir.iterdir():
        if entry.name != COMPONENTS[name].folder:
            (root / entry.name).symlink_to(entry)
    return consistent_component(root, name, **changes)


@pytest.mark.parametrize("name,key,value,fragment", [
    ("depth_decoder", "hidden_size", 32, "hidden_size is 32, expected 64, the language model's hidden_size"),
    ("depth_decoder", "num_codebooks", 4, "num_codebooks is 4, expected 8"),
    ("depth_decoder", "max_position_embeddings", 7, "max_position_embeddings is 7, expected at least 8"),
    ("condition_encoder", "condition_hidden_dim", 32, "condition_hidden_dim is 32, expected 64"),
    ("condition_encoder", "num_condition_layers", 4, "num_condition_layers is 4, expected 8"),
    ("condition_encoder", "out_dim", 16, "condition_dim is 32, expected 16, the condition encoder's out_dim"),
    ("dit", "in_channels", 64, "in_channels is 64, expected 128"),
    ("vocoder", "latent_channels", 64, "latent_channels is 64, expected 128"),
    ("vocoder", "upsampling_ratios", [8, 4, 4, 2], "upsampling_ratios is [8, 4, 4, 2], expected ratios that multiply"),
    ("vocoder", "sampling_rate", 32000, "sampling_rate is 32000, expected 44100"),
    ("language_model", "vocab_size", 160_000, "vocab_size is 160000, expected at least 168059"),
    ("language_model", "num_attention_heads", 3, "num_key_value_heads is 2, expected a divisor of"),
    ("language_model", "head_dim", 15, "head_dim is 15, expected an even number"),
    ("language_model", "max_position_embeddings", 2048, "max_position_embeddings is 2048, expected at least 10240"),
    ("depth_decoder", "num_attention_heads", 3, "num_attention_heads is 3, expected a divisor of hidden_size (64)"),
    ("dit", "rotary_dim", 32, "rotary_dim is 32, expected an even number up to attention_head_dim (16)"),
    ("dit", "rotary_dim", 7, "rotary_dim is 7, expected an even number"),
    ("dit", "fourier_embedding_dim", 15, "fourier_embedding_dim is 15, expected an even number"),
])
def test_components_that_do_not_fit_together(tiny_dir: Path, tmp_path: Path, name: str, key: str, value, fragment: str) -> None:
    """Each component loads on its own, but together (or with the shapes its attention and embeddings need) they break
    the contract: the load fails naming the config and the value, before any weights are read (these used to fail in
    the first song with a shape error from deep in the model, or, for the vocoder's rate and ratios and an odd DiT
    rotary width, to give wrong audio without a word)."""
    root = checkpoint_with(tiny_dir, tmp_path, name, **{key: value})
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_models(root, "cpu")
    assert fragment in str(info.value) and "config.json" in str(info.value), str(info.value)


def test_a_pipeline_index_naming_another_pipeline_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    root = tiny_with_json(tiny_dir, tmp_path, "modular_model_index.json", _class_name="QwenImageModularPipeline")
    says = 'is not a MiniMaxMusic3ModularPipeline.s .its _class_name is "QwenImageModularPipeline"'
    with pytest.raises(CheckpointError, match=says):
        checkpoint_checks.check_layout(root)


def test_a_vocabulary_ending_at_the_last_audio_code_fits_and_one_less_does_not(tiny_dir: Path, tmp_path: Path) -> None:
    codes = contract.AUDIO_CODE_OFFSET + contract.SEMANTIC_CODES  # the last audio code + 1
    config = "language_model/config.json"
    checkpoint_checks.check_fit(tiny_with_json(tiny_dir, tmp_path / "fits", config, vocab_size=codes))
    short = tiny_with_json(tiny_dir, tmp_path / "short", config, vocab_size=codes - 1)
    with pytest.raises(CheckpointError, match=f"vocab_size is {codes - 1}, expected at least {codes}, the last audio"):
        checkpoint_checks.check_fit(short)


def test_undamaged_copy_loads(tiny_dir: Path, tmp_path: Path) -> None:
    """The copies above fail only because of the damage."""
    for name in COMPONENTS:
        root, _ = copy_component(tiny_dir, tmp_path / name, name)
        load_component(root, name, "cpu", torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Loading streams tensor by tensor into parameters built without an init pass


@pytest.mark.parametrize("name", ["language_model", "dit", "vocoder"])
def test_load_streams_tensors(tiny_dir: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No state dict: at most a couple of tensors read from disk are alive at once, and the module is built on
    the meta device (no random init of full-size weights that would be overwritten)."""
    original_read = checkpoint_reader.TensorReader.read
    alive: list[weakref.ref] = []
    peak = {"tensors": 0, "reads": 0}

    def read(self, key, shape, rows=None):
        tensor = original_read(self, key, shape, rows)
        alive[:] = [ref for ref in alive if ref() is not None]
        alive.append(weakref.ref(tensor))
        peak["tensors"] = max(peak["tensors"], len(alive))
        peak["reads"] += 1
        return tensor

    init_devices: set[str] = set()
    for fn_name in ("kaiming_uniform_", "uniform_", "normal_"):
        original = getattr(torch.nn.init, fn_name)

        def traced(tensor, *args, _original=original, **kwargs):
            init_devices.add(tensor.device.type)
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.nn.init, fn_name, traced)
    monkeypatch.setattr(checkpoint_reader.TensorReader, "read", read)

    module = load_component(tiny_dir, name, "cpu", torch.float32)
    assert peak["reads"] >= 10
    # fill_parameter keeps the previous tensor alive while reading the next one; a weight-norm pair reads two.
    assert peak["tensors"] <= 3, peak
    assert init_devices <= {"meta"}, init_devices
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in module.parameters())
    assert not any(p.requires_grad for p in module.parameters())


def test_load_keeps_disk_dtype_by_default(tiny_dir: Path) -> None:
    module = load_component(tiny_dir, "language_model")
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert torch.equal(module.head.weight, file_tensors(tiny_dir / "language_model")["lm_head.weight"][LEGAL_ROWS])


def test_loading_shows_a_bar_of_every_byte_only_when_asked(tiny_dir: Path, capsys) -> None:
    quiet = load_component(tiny_dir, "vocoder")
    assert capsys.readouterr().err == ""
    shown = load_component(tiny_dir, "vocoder", progress=True)
    size = sum(p.numel() * p.element_size() for p in shown.parameters())
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    total = tqdm.format_sizeof(size)
    assert bar.startswith("loading vocoder: 100%") and f"| {total}/{total} [" in bar, (bar, size)
    assert all(torch.equal(a, b) for a, b in zip(quiet.state_dict().values(), shown.state_dict().values()))
