"""Counter-based draws: open interval, keyed, and top-k sampling never leaves the kept columns."""

from __future__ import annotations

import torch

from music3serve.hashing import MASK32, as_int64, mix32
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


def test_draws_depend_on_every_bit_of_the_seed():
    """Seeds are 64-bit: the high 32 bits key the draws too, so seeds 2**32 apart draw different songs."""
    seeds = torch.tensor([7, 7 + 2**32, 7 + 2**62])
    u = uniform_draws(seeds, torch.full((3,), 5), codebook=2, columns=1000)
    for a in range(3):
        for b in range(a + 1, 3):
            assert not torch.equal(u[a], u[b]), (seeds[a], seeds[b])


def test_each_codebook_of_a_frame_draws_its_own_uncorrelated_uniforms():
    seeds, frames = torch.tensor([7]), torch.tensor([3])
    u = torch.cat([uniform_draws(seeds, frames, codebook, 4096) for codebook in range(8)])  # [8, 4096]
    corr = torch.corrcoef(u.double())
    for a in range(8):
        for b in range(a + 1, 8):
            assert not torch.equal(u[a], u[b]), (a, b)
            assert abs(float(corr[a, b])) < 0.05, (a, b, float(corr[a, b]))


def test_nan_logits_are_never_drawn_and_draw_as_minus_infinity():
    """A NaN logit (say a bad row from the model) counts as -inf: argmax would pick a NaN column over any other."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=generator) * 3
    top = logits.topk(5, dim=-1).indices
    nan = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top, True)  # the 5 largest of each row
    seeds, frames = torch.arange(64) * 31, torch.arange(64) + 2
    codes = sample_top_k(logits.masked_fill(nan, float("nan")), 50, seeds, frames, 1)
    assert not nan.gather(1, codes[:, None]).any()
    assert torch.equal(codes, sample_top_k(logits.masked_fill(nan, float("-inf")), 50, seeds, frames, 1))


def reference_uniforms(seed: int, frame: int, codebook: int, columns: int) -> list[float]:
    """uniform_draws for one unsigned 64-bit seed in plain Python ints (no int64 tensor to overflow)."""
    state = mix32((seed & MASK32) ^ mix32(seed >> 32))
    state = mix32(state ^ mix32(frame))
    state = mix32(state ^ mix32(codebook + 0x9E37))
    return [((mix32(state ^ mix32(c + 0x51ED27)) >> 9) + 0.5) / (1 << 23) for c in range(columns)]


def test_every_unsigned_64_bit_seed_draws_as_its_plain_integer_key():
    """Seeds up to 2**64 - 1 sit in the int64 seed tensor as their two's complement twins (hashing.as_int64); the
    draws equal the keying computed on the unsigned seed itself, so seeds below 2**63 draw what they always drew
    and a seed s >= 2**63 draws other uniforms than s - 2**63."""
    seeds = [0, 7, 2**32 + 5, 2**63 - 1, 2**63, 2**63 + 7, 2**64 - 1]
    tensor = torch.tensor([as_int64(s) for s in seeds], dtype=torch.int64)
    got = uniform_draws(tensor, torch.full((len(seeds),), 11), codebook=3, columns=64)
    for row, seed in zip(got, seeds):
        assert row.tolist() == reference_uniforms(seed, 11, 3, 64)
    assert not torch.equal(got[seeds.index(2**63 + 7)], got[seeds.index(7)])
    assert as_int64(2**63 - 1) == 2**63 - 1 and as_int64(2**64 - 1) == -1
