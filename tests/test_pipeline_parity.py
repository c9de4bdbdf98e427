"""End-to-end parity with the diffusers 0.42.1 pipeline on the tiny checkpoint (float32).

Both sides draw with the same rule: the reference's `_sample_top_k` (its final top-k and multinomial draw)
is replaced by our counter-based Gumbel top-k, keyed by its call order (8 draws per frame); the reference
keeps its own logits, guidance and top-50 conditional restriction. Its per-window noise is replaced by ours.
Everything else runs as diffusers wrote it. tests/test_sampling.py covers the draws themselves.
The last tests hold the Euler schedule, the seconds-to-frames conversion and the window layout exactly to the
reference's own blocks, for every step count and song length they can be checked at in a fraction of a second.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import diffusers.modular_pipelines.minimax_music3.before_denoise as ref_before_denoise
import diffusers.modular_pipelines.minimax_music3.decoders as ref_decoders
import diffusers.modular_pipelines.minimax_music3.denoise as ref_denoise
import diffusers.modular_pipelines.minimax_music3.encoders as ref_encoders
from diffusers.modular_pipelines import MiniMaxMusic3Blocks
from diffusers.modular_pipelines.minimax_music3.before_denoise import MiniMaxMusic3PrepareChunksStep
from diffusers.modular_pipelines.minimax_music3.denoise import MiniMaxMusic3ChunkSetTimestepsStep
from music3serve import contract
from music3serve.acoustic.solver import noise, time_grid
from music3serve.hashing import as_int64
from music3serve.acoustic.windows import song_windows
from music3serve.pipeline import Pipeline
from music3serve.prompt import MAX_STEPS, frames_for_duration
from music3serve.talker.windows import WindowTracker
from music3serve.talker.sampling import sample_top_k

CAPTION = "## Upbeat synth-pop\n- **female** vocals, 120 bpm"
LYRICS = "[Verse]\nneon lights are calling\n[Chorus] ignored text\nwe run ^ we fly"
# The stand-in takes the reference's own constants, so that a contract constant changed on our side shows as a
# difference (test_contract_constants_are_the_references names it).
LEGAL = torch.tensor([ref_encoders._AUDIO_END_TOKEN_ID, *range(
    ref_encoders._AUDIO_CODE_OFFSET, ref_encoders._AUDIO_CODE_OFFSET + ref_encoders._SEMANTIC_VOCAB_SIZE
)])


class SharedDraws:
    """Stands in for the reference's sampler and noise, with our keyed draws."""

    def __init__(self, seed: int):
        self.seed, self.calls, self.windows = seed, 0, 0

    def sample_top_k(self, logits: torch.Tensor, generator=None) -> torch.Tensor:
        frame, codebook = divmod(self.calls, contract.NUM_CODEBOOKS)
        self.calls += 1
        legal = logits[:, LEGAL] if codebook == 0 else logits
        column = sample_top_k(
            legal, ref_encoders._AR_SAMPLING_TOP_K, torch.tensor([as_int64(self.seed)]), torch.tensor([frame]), codebook
        )
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
    ("duration", "windows", "steps", "seed"),
    [
        (5.0, 1, 30, 1234), (10.0, 2, 30, 1234), (22.0, 5, 8, 1234),  # 125, 250, 550 frames; the 5th window 150
        (0.04, 1, 1, 0),  # the shortest song: 1 frame (a 3-column window), 1 Euler step, seed 0
        (2.0, 1, 2, 2**64 - 1),  # 50 frames with the largest seed (its int64 twin in the sampler is -1)
    ],
)
def test_song_equals_reference(ours, reference, monkeypatch, duration, windows, steps, seed):
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
    assert not torch.equal(first.codes, other.codes) and not np.array_equal(first.waveform, other.waveform)


def test_contract_constants_are_the_references(reference):
    """Exact: the numbers contract.py pins are those the reference's modules and components hold. The stand-ins
    above read the reference's own, so a changed constant fails the parity runs too; this names it (the stand-in
    sampler once read our AR_TOP_K, and a top-k of 40 passed every parity test)."""
    assert (contract.AR_TOP_K, contract.AR_CFG_TOP_K, contract.AR_CFG_SCALE) == (
        ref_encoders._AR_SAMPLING_TOP_K, ref_encoders._AR_CFG_TOP_K, ref_encoders._AR_CFG_SCALE
    )
    assert (contract.AUDIO_END, contract.AUDIO_CFG, contract.AUDIO_CODE_OFFSET, contract.SEMANTIC_CODES) == (
        ref_encoders._AUDIO_END_TOKEN_ID, ref_encoders._AUDIO_CFG_TOKEN_ID, ref_encoders._AUDIO_CODE_OFFSET,
        ref_encoders._SEMANTIC_VOCAB_SIZE,
    )
    assert (contract.MAX_PROMPT_TOKENS, contract.MAX_FRAMES) == (
        ref_encoders._MAX_PROMPT_TOKENS, ref_encoders._MAX_AUDIO_FRAMES
    )
    assert (contract.WINDOW_FRAMES, contract.WINDOW_HOP, contract.OVERLAP_LATENT) == (
        ref_before_denoise._CHUNK_FRAMES, ref_before_denoise._CHUNK_HOP, ref_denoise._OVERLAP_LATENT_LENGTH
    )
    assert (contract.CROP_LEFT_LATENT, contract.CROP_RIGHT_LATENT) == (
        ref_decoders._CROP_LEFT_LATENT, ref_decoders._CROP_RIGHT_LATENT
    )
    assert contract.DIT_CFG_SCALE == reference.guider.guidance_scale


def test_time_grid_is_the_reference_schedule_for_every_step_count(reference):
    """Exact: for every step count a request may ask for, our float32 times are the timesteps the reference's
    set_timesteps block gives its scheduler, and its sigmas (whose differences are the Euler dt) with the final 1."""
    block = MiniMaxMusic3ChunkSetTimestepsStep()
    for steps in range(1, MAX_STEPS + 1):
        _, state = block(reference, SimpleNamespace(num_inference_steps=steps), 0)
        grid = time_grid(steps)
        assert torch.equal(state.timesteps, grid[:-1]), steps
        assert torch.equal(reference.scheduler.sigmas, grid), steps


@pytest.mark.parametrize(
    ("duration", "frames"),
    [(0.04, 1), (0.07, 1), (4.0, 100), (7.96, 199), (8.0, 200), (8.04, 200), (8.05, 201), (12.0, 300), (12.04, 301),
     (1.16, 28), (359.99, 8999), (360, 9000)],
)
def test_duration_to_frames_as_the_reference_converts(reference, duration, frames):
    """Exact: seconds -> frames with the reference's float arithmetic (int(duration * frame_rate), its frame_rate
    read from the condition encoder's config as 24000 / 960). 8.04 s is 200.99999999999997 frames, so 200 frames and
    one window, not 201 and two (1.16 s: 28 frames, not 29); 12.04 s is 301.0 frames, three windows."""
    assert frames_for_duration(duration) == min(int(duration * reference.frame_rate), contract.MAX_FRAMES) == frames


def test_streamed_windows_are_the_reference_chunks_for_every_length():
    """Exact, for every song length up to 1000 frames and the longest: the windows the talker hands on frame by frame
    (WindowTracker.ready, then .finish at the song's end) and song_windows are the reference's chunk starts, each
    covering frames [start, min(start + 200, frames)) (the reference's chunk_end), only the final one uncropped on
    the right."""
    chunk_starts = MiniMaxMusic3PrepareChunksStep().init_pipeline()
    for frames in [*range(1, 1001), contract.MAX_FRAMES]:
        starts = chunk_starts(frame_hiddens=torch.empty(1, frames, 0), output="chunk_starts")
        expected = [(s, min(s + 200, frames) - s, i == len(starts) - 1) for i, s in enumerate(starts)]
        tracker, streamed = WindowTracker(), []
        for count in range(1, frames + 1):
            streamed += tracker.ready(count)
        streamed += tracker.finish(frames)
        for windows in (streamed, song_windows(frames)):
            assert [(w.start, w.frames, w.last) for w in windows] == expected, frames
            assert [w.index for w in windows] == list(range(len(starts)))
