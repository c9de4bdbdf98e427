"""Counter-based draws: open interval, keyed, and top-k sampling never leaves the kept columns."""

from __future__ import annotations

import torch

from music3serve.talker.sampling import guided_draw, keep_top_k, sample_top_k, uniform_draws


def test_draws_are_strictly_inside_zero_one_and_keyed():
    seeds = torch.arange(64)
    for frame in range(0, 4000, 97):
        u = uniform_draws(seeds, torch.full((64,), frame), codebook=frame % 8, columns=16385)
        assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    a = uniform_draws(torch.tensor([7, 7]), torch.tensor([3, 4]), 0, 1000)
    assert torch.equal(a[0], uniform_draws(torch.tensor([7]), torch.tensor([3]), 0, 1000)[0])
    assert not torch.equal(a[0], a[1])


def test_sampling_stays_in_the_top_k_and_follows_softmax():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(0)) * 3
    kept = keep_top_k(logits, 50)
    allowed = torch.isfinite(kept[0])
    counts = torch.zeros(300)
    for frame in range(6000):
        code = int(sample_top_k(logits, 50, torch.tensor([11]), torch.tensor([frame]), 1)[0])
        assert allowed[code]
        counts[code] += 1
    assert (counts / 6000 - torch.softmax(kept[0], -1)).abs().max() < 0.02


def test_guided_draw_widens_bf16_logits_before_any_arithmetic():
    """The talker hands the head GEMMs' bf16 logits to the sampler as they are (LanguageModel.logits(widen=False)):
    the codes must be those of the float32 logits, so the blend and the draw never run in bf16."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(512, 1025, generator=generator) * 4).bfloat16()  # 256 songs: bf16 blends flip some draws
    seeds, frames = torch.arange(256) * 7919, torch.arange(256) + 11
    for cond_top_k in (0, 200):
        draws = [guided_draw(x, 1.5, 50, seeds, frames, 3, cond_top_k=cond_top_k) for x in (logits, logits.float())]
        assert torch.equal(*draws)
