"""End-to-end parity with the diffusers 0.42.1 pipeline on the tiny checkpoint (float32).

Both sides draw with the same rule: the reference's `_sample_top_k` (its final top-k and multinomial draw)
is replaced by our counter-based Gumbel top-k, keyed by its call order (8 draws per frame); the reference
keeps its own logits, guidance and top-50 conditional restriction. Its per-window noise is replaced by ours.
Everything else runs as diffusers wrote it. tests/test_sampling.py covers the draws themselves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import diffusers.modular_pipelines.minimax_music3.denoise as ref_denoise
import diffusers.modular_pipelines.minimax_music3.encoders as ref_encoders
from diffusers.modular_pipelines import MiniMaxMusic3Blocks
from music3serve import contract
from music3serve.acoustic.solver import noise
from music3serve.acoustic.windows import song_windows
from music3serve.pipeline import Pipeline
from music3serve.talker.sampling import sample_top_k

CAPTION = "## Upbeat synth-pop\n- **female** vocals, 120 bpm"
LYRICS = "[Verse]\nneon lights are calling\n[Chorus] ignored text\nwe run ^ we fly"
LEGAL = torch.tensor([contract.AUDIO_END, *range(contract.AUDIO_CODE_OFFSET, contract.AUDIO_CODE_OFFSET + contract.SEMANTIC_CODES)])


class SharedDraws:
    """Stands in for the reference's sampler and noise, with our keyed draws."""

    def __init__(self, seed: int):
        self.seed, self.calls, self.windows = seed, 0, 0

    def sample_top_k(self, logits: torch.Tensor, generator=None) -> torch.Tensor:
        frame, codebook = divmod(self.calls, contract.NUM_CODEBOOKS)
        self.calls += 1
        legal = logits[:, LEGAL] if codebook == 0 else logits
        column = sample_top_k(legal, contract.AR_TOP_K, torch.tensor([self.seed]), torch.tensor([frame]), codebook)
        return LEGAL[column] if codebook == 0 else column

    def randn_tensor(self, shape, generator=None, device=None, dtype=None):
        assert shape[0] == 1 and shape[1] == contract.LATENT_CHANNELS
        self.windows += 1
        return noise(self.seed, self.windows - 1, shape[2])[None].to(device=device, dtype=dtype)


@pytest.fixture(scope="module")
def reference(tiny_dir: Path):
    pipe = MiniMaxMusic3Blocks().init_pipeline(str(tiny_dir))
    pipe.load_components(torch_dtype=torch.float32)
    return pipe


@pytest.fixture(scope="module")
def ours(tiny_dir: Path) -> Pipeline:
    return Pipeline.from_pretrained(tiny_dir, device="cpu", talker_dtype=torch.float32)


def run_reference(pipe, monkeypatch, seed: int, duration: float, steps: int) -> dict:
    draws = SharedDraws(seed)
    monkeypatch.setattr(ref_encoders, "_sample_top_k", draws.sample_top_k)
    monkeypatch.setattr(ref_denoise, "randn_tensor", draws.randn_tensor)
    outputs = ["audios", "frame_hiddens", "latent_chunks"]
    out = pipe(prompt=CAPTION, lyrics=LYRICS, audio_duration=duration, num_inference_steps=steps, output=outputs)
    return dict(zip(outputs, out)) if isinstance(out, (list, tuple)) else out


def rel(a, b) -> float:
    a, b = torch.as_tensor(np.asarray(a)).double(), torch.as_tensor(np.asarray(b)).double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_same_song(ours_song, ref: dict) -> None:
    frames = ref["frame_hiddens"].shape[1]
    assert ours_song.frames == frames
    assert rel(ours_song.conditioning, ref["frame_hiddens"][0]) < 1e-4
    assert len(ours_song.latents) == len(ref["latent_chunks"]) == len(song_windows(frames))
    for mine, theirs in zip(ours_song.latents, ref["latent_chunks"]):
        assert rel(mine, theirs[0]) < 1e-4
    assert rel(ours_song.waveform, ref["audios"][0]) < 1e-4


@pytest.mark.parametrize(
    ("duration", "windows", "steps"),
    [(5.0, 1, 30), (10.0, 2, 30), (22.0, 5, 8)],  # 125, 250 and 550 frames; the 5th window is 150 frames
)
def test_song_equals_reference(ours, reference, monkeypatch, duration, windows, steps):
    seed = 1234
    song = ours.generate(CAPTION, LYRICS, duration, seed, steps=steps, trace=True)
    assert song.ended_by == "budget" and song.frames == int(duration * contract.FRAME_RATE)
    assert len(song_windows(song.frames)) == windows
    assert_same_song(song, run_reference(reference, monkeypatch, seed, duration, steps))


def test_song_ended_by_audio_end_equals_reference(ending_dir, monkeypatch):
    ours = Pipeline.from_pretrained(ending_dir, device="cpu", talker_dtype=torch.float32)
    duration = 20.0
    for seed in range(10):
        song = ours.generate(CAPTION, LYRICS, duration, seed, steps=4, trace=True)
        if song.ended_by == "audio_end" and song.frames >= 10:
            break
    else:
        pytest.fail("no seed in 0..9 ended the song early; the boosted checkpoint no longer does its job")
    assert song.frames < song.budget
    reference = MiniMaxMusic3Blocks().init_pipeline(str(ending_dir))
    reference.load_components(torch_dtype=torch.float32)
    assert_same_song(song, run_reference(reference, monkeypatch, seed, duration, 4))


def test_same_seed_same_song_and_other_seed_differs(ours):
    first = ours.generate(CAPTION, LYRICS, 2.0, 7, steps=2)
    again = ours.generate(CAPTION, LYRICS, 2.0, 7, steps=2)
    other = ours.generate(CAPTION, LYRICS, 2.0, 8, steps=2)
    assert torch.equal(first.codes, again.codes) and np.array_equal(first.waveform, again.waveform)
    assert not torch.equal(first.codes, other.codes)
