"""The README's memory table and the 24 GB example deploy file against the model code at full size (meta tensors:
nothing is allocated)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from music3serve import contract
from music3serve.acoustic.precision import BFLOAT16, FLOAT32, FP8, PrecisionPolicy, apply_policy
from music3serve.bench.common import full_size
from music3serve.memory import GIB, module_bytes
from music3serve.serving.deploy_config import load_deploy_config
from music3serve.talker.memory_check import device_bytes, row_bytes
from music3serve.talker.quantize import quantize_talker

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def gigabytes(*modules: torch.nn.Module) -> float:
    return module_bytes(*modules) / 1e9


def readme_row(label: str) -> list[float]:
    """The GB figures of the README's memory-table row starting with `label`: FP8, bf16, float32."""
    row = next(line for line in README.read_text().splitlines() if line.startswith(f"| {label}"))
    return [float(cell) for cell in re.findall(r"\| ([\d.]+) GB", row)]


def test_the_readme_gives_the_talkers_weight_bytes_the_code_holds():
    lm, depth = full_size("language_model", torch.bfloat16), full_size("depth_decoder", torch.bfloat16)
    bf16 = gigabytes(lm, depth)
    quantize_talker(lm, depth)
    fp8 = gigabytes(lm, depth)
    assert readme_row("talker weights") == [round(fp8, 1), round(bf16, 1), round(2 * bf16, 1)]


def test_the_readme_gives_the_acoustic_decoders_weight_bytes_the_code_holds():
    """Each precision's policy casts the modules as the engine does (some float32 islands stay in bf16 and FP8)."""
    held = []
    for policy in (FP8, BFLOAT16, FLOAT32):
        modules = [full_size(name, torch.float32) for name in ("condition_encoder", "dit", "vocoder")]
        apply_policy(*modules, policy)
        held.append(round(gigabytes(*modules), 1))
    assert readme_row("acoustic decoder weights") == held


def test_the_24gb_example_fits_its_shares_of_a_22_gib_card():
    """examples/deploy/fp8_24gb.yaml: what each stage's start-up check counts (the talker's weights, lookup table, KV
    and frame conditioning; stage 1's weights in FP8) fits its gpu_memory_utilization of a card with 22 GiB usable,
    and the two shares leave room for activations and graphs. The peak under a 22 GiB cap is for `bench/gpu_fp8.sh`
    (`python -m music3serve.bench.fp8 memory`) to measure."""
    deploy = load_deploy_config(ROOT / "examples" / "deploy" / "fp8_24gb.yaml")
    s0, s1 = deploy.stages
    assert (s0.quantization, s1.quantization, s0.max_model_len) == ("fp8", "fp8", contract.MAX_CONTEXT)
    lm, depth = full_size("language_model", torch.bfloat16), full_size("depth_decoder", torch.bfloat16)
    quantize_talker(lm, depth)
    config = deploy.talker_config()
    talker = device_bytes(lm, depth, config) + sum(row_bytes(lm, s0.max_num_seqs // 2, config))
    stage1 = [full_size(name, torch.float32) for name in ("condition_encoder", "dit", "vocoder")]
    apply_policy(*stage1, PrecisionPolicy.named(s1.precision))
    card = 22 * GIB
    assert talker <= s0.gpu_memory_utilization * card
    assert gigabytes(*stage1) * 1e9 <= s1.gpu_memory_utilization * card
    assert s0.gpu_memory_utilization + s1.gpu_memory_utilization <= 0.9
    # docs/configuration.md's table says these numbers, in GiB
    kv, conditioning = row_bytes(lm, s0.max_num_seqs // 2, config)
    said = {stage: [float(x) for x in re.findall(r"([\d.]+) GiB", row)] for stage, row in config_table_rows().items()}
    assert said["0"] == [round(x / GIB, 1) for x in (s0.gpu_memory_utilization * card, talker - kv - conditioning, kv,
                                                     conditioning, talker)]
    assert said["1"] == [round(x, 1) for x in (s1.gpu_memory_utilization * 22, gigabytes(*stage1) * 1e9 / GIB)]


def config_table_rows() -> dict[str, str]:
    """docs/configuration.md, section "A 24 GB card": its table's rows by stage."""
    section = (ROOT / "docs" / "configuration.md").read_text().split("## A 24 GB card")[1].split("\n## ")[0]
    return {line.split("|")[1].strip(): line for line in section.splitlines() if re.match(r"\| [01] \|", line)}


def test_the_24gb_example_serves_songs_as_written(tiny_dir):
    """The file loads and runs: two songs at once through an FP8 engine built from it (tiny checkpoint, CPU)."""
    import asyncio

    from music3serve.checkpoint import load_models
    from music3serve.serving.engine import Engine
    from music3serve.serving.events import Done, SongRequest

    deploy = load_deploy_config(ROOT / "examples" / "deploy" / "fp8_24gb.yaml")
    engine = Engine(load_models(tiny_dir, "cpu", quantization="fp8"), deploy)

    async def song(seed: int) -> list:
        return [event async for event in engine.submit(SongRequest("pop", "[verse]\nla la", 2.0, seed=seed, steps=2))]

    async def both() -> list:
        return await asyncio.gather(song(1), song(2))

    try:
        songs = asyncio.run(asyncio.wait_for(both(), 120))
    finally:
        engine.close()
    assert all(isinstance(events[-1], Done) for events in songs)


def test_the_readme_gives_a_songs_kv_bytes_the_code_holds():
    """Two rows of the full context a song (cond + uncond); FP8 keeps the KV in bf16."""
    from music3serve.talker.slots import SlotCache

    lm = full_size("language_model", torch.bfloat16)
    per_song = [SlotCache.bytes_needed(lm.cfg, 1, contract.MAX_CONTEXT, dtype) / GIB
                for dtype in (torch.bfloat16, torch.bfloat16, torch.float32)]
    row = next(line for line in README.read_text().splitlines() if line.startswith("| talker KV cache"))
    assert [float(x) for x in re.findall(r"\| ([\d.]+) GiB", row)] == [round(x, 1) for x in per_song]
