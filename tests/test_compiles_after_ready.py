"""Once the engine is ready, songs compile nothing: its warm-up runs every shape they take. A compile while songs
play stalls every song of its stage (seconds on the GPU). On the CPU with fusion on, traced by the aot_eager backend
(dynamo's graphs and guards without code generation), stage 1 in bf16 and FP8 (both stages, emulated on the CPU)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from music3serve.bench.common import compiled_graphs
from music3serve.checkpoint import load_models
from music3serve.models.fusion import enable_fusion, graphs_per_function
from music3serve.serving.deploy_config import load_deploy_config, with_quantization, with_stage1_dtype
from music3serve.serving.engine import Engine
from music3serve.serving.events import AudioChunk, Done, SongRequest

LYRICS = "[verse]\nneon lights over the city\n[chorus]\nwe sing"


async def song(engine: Engine, seed: int, duration: float, caption: str = "pop song", playing=None) -> None:
    """A song to its end; `playing` is set at its first audio."""
    async for event in engine.submit(SongRequest(caption, LYRICS, duration, seed=seed)):
        if isinstance(event, AudioChunk) and playing is not None:
            playing.set()
        assert not isinstance(event, Done) or event.frames > 0


async def two_at_once(engine: Engine) -> None:
    await asyncio.gather(song(engine, 2, 10.0), song(engine, 5, 6.0, "jazz"))


async def beside_a_prefill(engine: Engine) -> None:
    """A song whose prompt (a longer one) is prefilled while another song decodes."""
    playing = asyncio.Event()
    first = asyncio.create_task(song(engine, 3, 10.0, "ambient", playing))
    await playing.wait()
    await song(engine, 4, 6.0, "a folk ballad with a long description of guitars, harmonica and a slow waltz beat")
    await first


@pytest.mark.parametrize("stage1, quantization", [("bfloat16", "none"), ("bfloat16", "fp8")], ids=["bf16", "fp8"])
def test_songs_after_ready_compile_nothing(tiny_dir, stage1, quantization):
    """A 10 s song (a full window and a shorter last one), two songs at once (a 6 s one: a short first window), then
    a song beside a prefill. The talker in bf16 as on the GPU."""
    torch._dynamo.reset()  # graphs of earlier tests in this process would spare the warm-up its compiles
    deploy = with_stage1_dtype(with_quantization(load_deploy_config(), quantization), stage1)
    models = load_models(tiny_dir, talker_dtype=torch.bfloat16, quantization=quantization)
    enable_fusion(backend="aot_eager")
    engine = Engine(models, deploy)
    try:
        at_ready, functions = compiled_graphs(), graphs_per_function()
        assert at_ready > 0
        for songs in (song(engine, 1, 10.0), two_at_once(engine), beside_a_prefill(engine)):
            asyncio.run(asyncio.wait_for(songs, 300))
    finally:
        engine.close()
    compiled = {name: n - functions.get(name, 0) for name, n in graphs_per_function().items()
                if n != functions.get(name, 0)}
    assert (compiled_graphs() - at_ready, compiled) == (0, {})
