"""GPU: a song is the same whatever else the engine holds.

Its 750 frames of codes and its frame conditioning come out bit for bit the same alone and beside 1, 3, 7 and 15 other
songs admitted at other steps, and beside songs of other prompts and seeds with garbage in every free row; its windows
rendered beside other songs' windows stay within the measured bound of rendering them alone.

A mid-size random model keeps the run short: the talker at its full widths (every GEMM, attention and sampling shape
of the released checkpoint, so the same kernels, tiles and row counts: up to 32 rows, 64 in the depth decoder's first
call) with 4 backbone layers instead of 36, KV slots of 4097 positions (at most 8 attention shares, as at full
capacity), the song's prompt 1400 tokens long so that its length crosses 2048 positions, where its shares grow past
their least 4 blocks; the DiT at its full widths with 2 layers instead of 36. Random weights make near-uniform
logits, so any difference in rounding would change a code within a few frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import pytest
import torch

from music3serve.acoustic.precision import BFLOAT16, FLOAT32
from music3serve.acoustic.renderer import Renderer
from music3serve.acoustic.windows import song_windows
from music3serve.bench.common import random_module
from music3serve.models.fusion import disable_fusion
from music3serve.prompt import unconditional_ids
from music3serve.talker.engine import Talker, TalkerConfig
from music3serve.talker.events import SongFailed, SongFinished, WindowReady

pytestmark = pytest.mark.gpu

FRAMES = 750
SONG = "the song"
PROMPT = 1400  # tokens of the song's prompt
# Stage 1 batches with cuBLAS, whose kernel follows the batch, so a window rendered beside others rounds differently
# from the same window alone. Measured on the H200 over the song's first three windows beside seven others (2026-12-04):
# the latents' relative L2 difference 7.9e-7 (float32) and 1.3e-3 (bfloat16); the random vocoder amplifies and
# saturates (88% of the samples at full scale), so its PCM moved by up to 0.021 in float32 and, where a saturated
# sample flipped sign, by 2 in bfloat16 (no bound there). The bounds are about three times what was measured.
LATENT_BOUND = {"float32": 3e-6, "bfloat16": 5e-3}
PCM_BOUND = {"float32": 0.07}


@dataclass(frozen=True)
class Song:
    id: str
    prompt_tokens: int
    seed: int
    frames: int
    arrival: int  # the talker step at which it is submitted

    def ids(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 7919 + self.prompt_tokens)
        return torch.randint(0, 151643, (self.prompt_tokens,), generator=generator).tolist()


def others(count: int, seed: int) -> list[Song]:
    """`count` songs of varied prompts and lengths (some end while the song is written), arriving at varied steps."""
    generator = torch.Generator().manual_seed(seed)
    return [
        Song(f"other {i}", int(torch.randint(5, 400, (), generator=generator)), seed * 100 + i,
             int(torch.randint(60, FRAMES + 100, (), generator=generator)),
             int(torch.randint(0, 120, (), generator=generator)))
        for i in range(count)
    ]


def make_talker() -> Talker:
    """The mid-size talker of these tests (module docstring), on the GPU."""
    lm = random_module("language_model", "cuda", torch.bfloat16, num_hidden_layers=4)
    depth = random_module("depth_decoder", "cuda", torch.bfloat16, seed=1)
    encoder = random_module("condition_encoder", "cuda", torch.float32, seed=2)
    config = TalkerConfig(max_num_seqs=32, max_model_len=4096, capture_sizes=(2, 4, 8, 16))  # 16 songs: eager
    return Talker(lm, depth, encoder, config)


def the_song(arrival: int, seed: int = 7) -> Song:
    return Song(SONG, PROMPT, seed, FRAMES, arrival)


@pytest.fixture(scope="module")
def talker() -> Iterator[Talker]:
    """One talker for the module: fusion, which it turns on, stays on across the tests (conftest) and goes off here."""
    yield make_talker()
    disable_fusion()


def fill_with_garbage(talker: Talker) -> None:
    """NaN in every KV row and in the hidden state of every free row, random seeds and frame counters in the free
    pairs: whatever a free row holds must never reach a song (talker idle)."""
    step = talker.step_fn
    talker.slots.k.fill_(float("nan"))
    talker.slots.v.fill_(float("nan"))
    step.hidden.fill_(float("nan"))
    step.seeds.random_(0, 2**62)
    step.frames.random_(0, 5000)


def run(talker: Talker, song: Song, beside: list[Song]) -> tuple[torch.Tensor, torch.Tensor]:
    """The song's codes [frames, 8] and mixed frame conditioning [frames, hidden] (float32, on the device)."""
    assert not talker.busy
    pending = sorted([song, *beside], key=lambda s: s.arrival)
    codes, mixed, step = None, [], 0
    while pending or talker.busy:
        while pending and pending[0].arrival <= step:
            s = pending.pop(0)
            talker.submit(s.id, s.ids(), unconditional_ids(s.ids()), s.seed, s.frames)
        for event in talker.step():
            assert not isinstance(event, SongFailed), event
            if event.song != song.id:
                continue
            if isinstance(event, WindowReady):
                if event.ready is not None:
                    event.ready.synchronize()
                mixed.append((event.window, event.mixed.clone()))
            elif isinstance(event, SongFinished):
                codes = event.codes
        step += 1
    frames = torch.full((song.frames, talker.lm.cfg.hidden), float("nan"), device=talker.device)
    for window, rows in mixed:
        frames[window.start : window.start + window.frames] = rows
    return codes, frames


@pytest.fixture(scope="module")
def solo(talker) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
    """The song's seed and its solo run: the first seed from 7 whose song runs all its frames (random weights sample
    audio_end with a chance of about 1 in 16385 a frame, so a seed may end its song early: seed 7 at frame 240 on the
    H200)."""
    for seed in range(7, 17):
        first = run(talker, the_song(0, seed), [])
        if first[0].shape == (FRAMES, 8):
            break
    else:
        pytest.fail(f"no seed of 7-16 gave a song of {FRAMES} frames")
    again = run(talker, the_song(5, seed), [])
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])  # a solo run repeats bit for bit
    return seed, first


def assert_same_song(codes: torch.Tensor, mixed: torch.Tensor, solo: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Codes and conditioning bit for bit those of the solo run; else where they part."""
    assert codes is not None and codes.shape == solo[0].shape, (
        f"the song ended after {None if codes is None else codes.shape[0]} frames, alone after {solo[0].shape[0]}")
    conditioning = (mixed != solo[1]).any(dim=1).nonzero()
    differing = (codes != solo[0]).any(dim=1).nonzero()
    assert not len(differing) and not len(conditioning), (
        f"codes differ from frame {differing[0].item() if len(differing) else None} on, the conditioning from frame "
        f"{conditioning[0].item() if len(conditioning) else None} on")


# One condition at a time (the song's pair, graph rows left idle, a pair moved when a song before it ends), then the
# deploys: the default file's 8 songs and one of 16 (beyond the largest captured size: eager steps), songs arriving
# and ending while the song is written.
SCENARIOS = {
    "in pair 1": (1, [Song("long", 120, 51, FRAMES + 50, 0)]),
    "beside idle graph rows": (0, [Song("long", 120, 51, FRAMES + 50, 0), Song("long 2", 60, 52, FRAMES + 50, 0)]),
    "moved to pair 0": (1, [Song("short", 120, 51, 90, 0)]),
    "beside 1": (3, others(1, seed=1)),
    "beside 3": (40, others(3, seed=3)),
    "beside 7": (0, others(7, seed=7)),
    "beside 15": (17, others(15, seed=15)),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_songs_codes_and_conditioning_do_not_depend_on_the_songs_beside_it(talker, solo, scenario):
    arrival, beside = SCENARIOS[scenario]
    seed, alone = solo
    assert_same_song(*run(talker, the_song(arrival, seed), beside), alone)


def test_nothing_but_rounding_could_differ_other_prompts_seeds_and_garbage_in_free_rows_change_nothing(talker, solo):
    fill_with_garbage(talker)
    seed, alone = solo
    assert_same_song(*run(talker, the_song(25, seed), others(7, seed=57)), alone)


@pytest.mark.parametrize("policy", [FLOAT32, BFLOAT16], ids=lambda p: p.name)
@torch.inference_mode()
def test_a_songs_windows_beside_other_songs_stay_within_the_measured_bound_of_rendering_them_alone(talker, solo,
                                                                                                    policy):
    encoder = random_module("condition_encoder", "cuda", torch.float32, seed=2)
    dit = random_module("dit", "cuda", torch.float32, seed=3, num_layers=2)
    renderer = Renderer(encoder, dit, random_module("vocoder", "cuda", torch.float32, seed=4), policy)
    windows = song_windows(FRAMES)[:3]
    generator = torch.Generator(device="cuda").manual_seed(11)
    conditioning = solo[1][1]
    beside = [conditioning[torch.randperm(FRAMES, generator=generator, device="cuda")] for _ in range(7)]
    pcm, latents = {}, {}
    for name, songs in (("alone", [conditioning]), ("beside seven", [conditioning, *beside])):
        rendered = []
        for index in range(len(windows)):
            payloads = [renderer.payloads((name, i), 7 + i, mixed)[index] for i, mixed in enumerate(songs)]
            rendered.append(renderer.render(payloads)[0])
        for i in range(len(songs)):
            renderer.cancel((name, i))
        pcm[name] = torch.cat([r.pcm for r in rendered], dim=-1)
        latents[name] = torch.cat([r.latent for r in rendered], dim=-1)
    difference = (pcm["alone"] - pcm["beside seven"]).abs().max().item()
    latent = ((latents["alone"] - latents["beside seven"]).norm() / latents["alone"].norm()).item()
    print(f"{policy.name}: largest |PCM difference| alone vs beside seven {difference:.3g} (full scale 1, "
          f"{(pcm['alone'].abs() == 1).float().mean().item():.1%} of the samples clamped); latents relative L2 "
          f"{latent:.3g}")
    assert latent <= LATENT_BOUND[policy.name]
    if policy.name in PCM_BOUND:
        assert difference <= PCM_BOUND[policy.name]
