"""`music3serve bench e2e`: the Engine end to end on full-size random weights: one 20 s song, eight 30 s songs."""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import contract
from ..checkpoint import ACOUSTIC, Music3Models
from ..errors import Music3Error
from ..serving.deploy_config import DeployConfig, load_deploy_config, with_quantization, with_stage1_dtype
from ..serving.engine import Engine
from ..serving.events import AudioChunk, Done, SongRequest
from ..serving.worker import RenderWorker
from ..talker.quantize import quantize_talker
from ..tokenizer import load_tokenizer, write_tokenizer
from .common import compiled_graphs, random_module, table

LYRICS = "[verse]\nCity lights are fading slow\n[chorus]\nHold on, hold on"


SCENARIOS = [("one 20 s song", [20.0]), ("eight 30 s songs", [30.0] * 8)]


PLACEMENTS = {
    "colocated": "one worker, two CUDA streams",
    "split": "stage 1 in a second worker on the second GPU, shared-memory connector",
    "split-one-gpu": "stage 1 in a second worker on the same GPU, shared-memory connector",
}


def random_acoustic(device: str, names: tuple[str, ...] = ACOUSTIC) -> SimpleNamespace:
    """Stage 1's components, full size, random weights, None for those not named (module level: a spawned worker
    calls it). Each component's weights depend only on its name."""
    return SimpleNamespace(**{n: random_module(n, device, torch.float32, seed=2 + i) if n in names else None
                              for i, n in enumerate(ACOUSTIC)})


def random_models(device: str, acoustic: bool = True, quantize: bool = False) -> Music3Models:
    """quantize: the talker's weights in FP8 (as the engine would quantize them), before stage 1's are made, so the
    bf16 talker and the float32 acoustic weights are never on the device together."""
    with tempfile.TemporaryDirectory() as folder:
        write_tokenizer(Path(folder))
        tokenizer = load_tokenizer(Path(folder))
    lm = random_module("language_model", device, torch.bfloat16)
    depth = random_module("depth_decoder", device, torch.bfloat16, seed=1)
    if quantize:
        quantize_talker(lm, depth)
    stage1 = random_acoustic(device, ACOUSTIC if acoustic else ACOUSTIC[:1])  # the talker mixes with the encoder
    return Music3Models(tokenizer=tokenizer, language_model=lm, depth_decoder=depth, **vars(stage1))


def random_engine(deploy: DeployConfig, placement: str = "colocated", device: str = "cuda") -> Engine:
    """An Engine on full-size random weights, stage 1 placed as PLACEMENTS says."""
    if placement not in PLACEMENTS:
        raise Music3Error(f"placement must be one of {sorted(PLACEMENTS)}, got {placement!r}")
    worker = None
    if placement != "colocated":
        if placement == "split" and torch.cuda.device_count() < 2:
            raise Music3Error("the split placement needs two GPUs; split-one-gpu runs both workers on one")
        worker = RenderWorker(random_acoustic, "cuda:1" if placement == "split" else "cuda:0", deploy.stages[1],
                              deploy.connector)
    try:
        return Engine(random_models(device, acoustic=worker is None), deploy, worker)
    except BaseException:
        if worker is not None:
            worker.close()
        raise


async def song(engine: Engine, duration: float, seed: int, steps: int = contract.DIT_STEPS) -> dict[str, float]:
    started, first, frames = time.perf_counter(), None, 0
    async for event in engine.submit(SongRequest(f"pop song {seed}", LYRICS, duration, seed=seed, steps=steps)):
        if isinstance(event, AudioChunk) and first is None:
            first = time.perf_counter() - started
        elif isinstance(event, Done):
            frames = event.frames
            print(f"  song {seed}: {frames} frames, first audio {first:.2f} s, done {time.perf_counter() - started:.2f} s",
                  flush=True)
    return {"first_audio_s": first, "total_s": time.perf_counter() - started, "frames": frames}


async def scenario(engine: Engine, durations: list[float]) -> tuple[list[dict[str, float]], float]:
    started = time.perf_counter()
    results = await asyncio.gather(*(song(engine, d, seed) for seed, d in enumerate(durations)))
    return list(results), time.perf_counter() - started


def run(
    device: str = "cuda", acoustic_dtype: str = "bfloat16", placement: str = "colocated", render_batch: int | None = None,
    quantization: str = "none",
) -> str:
    """render_batch: windows per render call (stage 1's max_num_batched_tokens); None keeps the default config's.
    quantization: both stages' (none or fp8)."""
    deploy = with_stage1_dtype(with_quantization(load_deploy_config(), quantization), acoustic_dtype)
    if render_batch is not None:
        if render_batch < 1:
            raise Music3Error(f"render_batch must be >= 1, got {render_batch}")
        stage1 = dataclasses.replace(deploy.stages[1], max_num_batched_tokens=render_batch)
        deploy = dataclasses.replace(deploy, stages=(deploy.stages[0], stage1))
    started = time.perf_counter()
    engine = random_engine(deploy, placement, device)
    print(f"engine ready in {time.perf_counter() - started:.1f} s (fusion compile, graph capture)", flush=True)
    headers = ["scenario", "worst first audio s", "best first audio s", "total s", "x real time",
               "graphs compiled (this process)"]
    rows = []
    # If a scenario stalls, every thread's stack goes to stderr (the 2026-11-30 multi-song GPU run stalled).
    faulthandler.dump_traceback_later(90, repeat=True)
    try:
        asyncio.run(scenario(engine, [1.0]))  # warm-up: compiles the prefill shapes
        for label, durations in SCENARIOS:
            graphs = compiled_graphs()
            results, wall = asyncio.run(scenario(engine, durations))
            audio = sum(r["frames"] for r in results) / 25
            rows.append([label, max(r["first_audio_s"] for r in results), min(r["first_audio_s"] for r in results),
                         wall, audio / wall, compiled_graphs() - graphs])
            print(table(headers, rows[-1:]), flush=True)
    finally:
        faulthandler.cancel_dump_traceback_later()
        engine.close()
    setting = (f"quantization {quantization}, acoustic dtype {acoustic_dtype}, {placement} ({PLACEMENTS[placement]}), "
               f"render batch {deploy.stages[1].max_num_batched_tokens}")
    return setting + "\n\n" + table(headers, rows)
