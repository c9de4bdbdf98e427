"""GPU: several concurrent songs through the engine, colocated (both stages' graphs replaying at once) and split."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from music3serve.acoustic.windows import song_samples
from music3serve.checkpoint import load_models
from music3serve.errors import Music3Error
from music3serve.serving.deploy_config import load_deploy_config
from music3serve.serving.engine import Engine
from music3serve.serving.events import AudioChunk, Done, Failed, SongRequest
from shm_names import segments  # tests/ is on the import path (no package)

pytestmark = pytest.mark.gpu


async def song(engine: Engine, seed: int, duration: float) -> tuple[np.ndarray, int]:
    chunks, frames = [], 0
    async for event in engine.submit(SongRequest(f"pop {seed}", "[verse]\nla la", duration, seed=seed)):
        if isinstance(event, Failed):
            raise AssertionError(event.message)
        if isinstance(event, AudioChunk):
            chunks.append(event.pcm)
        if isinstance(event, Done):
            assert event.timings["first_audio_s"] <= event.timings["total_s"]
            frames = event.frames
    return np.concatenate(chunks, axis=-1), frames


@pytest.mark.parametrize("split", [False, True], ids=["colocated", "split"])
def test_concurrent_songs_complete(tiny_dir, split):
    """The stall seen on the H200 (2026-11-30): several songs at once never finished. Each must finish, with
    every window's audio (other songs change GEMM shapes on the GPU, so PCM is not compared bit for bit); split:
    stage 1 in a worker process on the same GPU, behind the outbox, the heartbeat and the shared-memory connector."""
    engine = Engine.from_pretrained(tiny_dir, device="cuda", split=True) if split else Engine(
        load_models(tiny_dir, device="cuda"))
    try:
        durations = {seed: 12.0 + 3 * seed for seed in range(4)}  # 3-4 windows each, overlapping renders

        async def together():
            return await asyncio.wait_for(asyncio.gather(*(song(engine, s, d) for s, d in durations.items())), 300)

        for (pcm, frames) in asyncio.run(together()):
            assert frames > 0 and pcm.shape == (2, song_samples(frames))
            assert np.isfinite(pcm).all() and np.abs(pcm).max() > 0
    finally:
        engine.close()
        torch.cuda.synchronize()
    if split:
        assert not segments(engine.worker.connector)


def test_stage1_weights_past_their_share_of_the_card_fail_at_startup(tiny_dir):
    """The CUDA branch of stage 1's memory check: a share of the card smaller than the tiny model's weights."""
    deploy = load_deploy_config()
    stage1 = dataclasses.replace(deploy.stages[1], gpu_memory_utilization=1e-9)
    with pytest.raises(Music3Error, match=r"stage 1 needs .* GiB of .* weights, more than gpu_memory_utilization 1e-09 "
                                          r"of the card \(0\.0 GiB\): raise it"):
        Engine(load_models(tiny_dir, device="cuda"), dataclasses.replace(deploy, stages=(deploy.stages[0], stage1)))
    torch.cuda.synchronize()
