"""Once the engine is ready, songs compile nothing: its warm-up runs every shape they take. A compile while songs
play stalls every song of its stage (seconds on the GPU). On the CPU with fusion on, traced by the aot_eager backend
(dynamo's graphs and guards without code generation), stage 1 in bf16 and FP8 (both stages, emulated on the CPU)."""

from __future__ import annotations

import pytest
import torch

from music3serve.bench.ready import measure


@pytest.mark.parametrize("precision", ["bfloat16", "fp8"])
def test_songs_after_ready_compile_nothing(tiny_dir, precision):
    """bench ready's songs after ready: a 10 s song (a full window, then a shorter one), two at once (one with a
    short first window), a song whose prompt is prefilled while another decodes. The talker in bf16 as on the GPU;
    two Euler steps a window (the same shapes as 30)."""
    torch._dynamo.reset()  # graphs of earlier tests in this process would spare the warm-up its compiles
    result = measure(precision, tiny_dir, cpu_fusion="aot_eager", steps=2)
    assert result["graphs_at_ready"] > 0
    assert (result["graphs_in_song"], result["compiled_in_song"]) == (0, {})
