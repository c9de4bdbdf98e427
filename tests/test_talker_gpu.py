"""GPU: the captured frame step replays exactly what the eager step computes."""

from __future__ import annotations

import pytest
import torch

from music3serve.checkpoint import load_models
from music3serve.prompt import encode_prompt
from music3serve.talker.engine import SongFinished, Talker, TalkerConfig, WindowReady

pytestmark = pytest.mark.gpu


def run_songs(models, enforce_eager: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    config = TalkerConfig(max_num_seqs=8, enforce_eager=enforce_eager, capture_sizes=(2, 4, 8))
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, config)
    for i, frames in enumerate((230, 40, 75)):
        cond, uncond = encode_prompt(models.tokenizer, f"song {i}", "[verse]\nla " * (i + 1))
        talker.submit(str(i), cond, uncond, seed=i, requested_frames=frames)
    windows, codes = {}, {}
    while talker.busy:
        for event in talker.step():
            if isinstance(event, WindowReady):
                windows.setdefault(event.song, []).append(event.mixed.cpu())
            elif isinstance(event, SongFinished):
                codes[event.song] = event.codes
    return {song: (codes[song], torch.cat(windows[song])) for song in codes}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager(tiny_dir, dtype):
    models = load_models(tiny_dir, device="cuda", talker_dtype=dtype)
    eager, graphs = run_songs(models, True), run_songs(models, False)
    assert set(eager) == set(graphs) == {"0", "1", "2"}
    for song in eager:
        assert torch.equal(eager[song][0], graphs[song][0])
        assert torch.equal(eager[song][1], graphs[song][1])
