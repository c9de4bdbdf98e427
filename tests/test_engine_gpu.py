"""GPU: several concurrent songs through the colocated engine (both stages' graphs replaying at once)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from music3serve.checkpoint import load_models
from music3serve.serving.engine import AudioChunk, Done, Engine, Failed, SongRequest

pytestmark = pytest.mark.gpu


async def song(engine: Engine, seed: int, duration: float) -> np.ndarray:
    chunks = []
    async for event in engine.submit(SongRequest(f"pop {seed}", "[verse]\nla la", duration, seed=seed)):
        if isinstance(event, Failed):
            raise AssertionError(event.message)
        if isinstance(event, AudioChunk):
            chunks.append(event.pcm)
        if isinstance(event, Done):
            assert event.timings["first_audio_s"] <= event.timings["total_s"]
    return np.concatenate(chunks, axis=-1)


def test_concurrent_songs_complete_and_match_their_solo_runs(tiny_dir):
    from music3serve.models.fusion import disable_fusion

    engine = Engine(load_models(tiny_dir, device="cuda"))
    try:
        durations = {seed: 12.0 + 3 * seed for seed in range(4)}  # 3-4 windows each, overlapping renders

        async def together():
            return await asyncio.wait_for(asyncio.gather(*(song(engine, s, d) for s, d in durations.items())), 300)

        async def alone(seed: int):
            return await asyncio.wait_for(song(engine, seed, durations[seed]), 300)

        concurrent = asyncio.run(together())
        for seed, pcm in zip(durations, concurrent):
            solo = asyncio.run(alone(seed))
            assert pcm.shape == solo.shape
            # Other songs change GEMM shapes and attention splits on the GPU, so not bit-exact: the
            # stages must not corrupt each other (a race shows up as garbage, not as rounding).
            assert np.abs(pcm - solo).max() < 0.1, f"song {seed} differs from its solo run"
    finally:
        engine.close()
        disable_fusion()
        torch.cuda.synchronize()
