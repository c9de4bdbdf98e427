"""Counter-based draws: open interval, keyed, and top-k sampling never leaves the kept columns."""

from __future__ import annotations

import torch

from music3serve.talker.sampling import keep_top_k, sample_top_k, uniform_draws


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
