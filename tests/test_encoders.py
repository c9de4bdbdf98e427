"""The streaming encoders alone: every lossy format gives decodable audio for each slice as it is fed, so a song's
first audio leaves after one slice's encoding (not after a muxer's page or buffer fills)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("av")

from music3serve import contract
from music3serve.serving.encoders import make_encoder, output_rate
from music3serve.serving.song_feed import FEED_SAMPLES, FIRST_FEED_SAMPLES, window_slices
from decoding import decode  # tests/ is on the import path (no package)

SECONDS = 3.0


def tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * contract.SAMPLE_RATE)) / contract.SAMPLE_RATE
    return np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)


@pytest.mark.parametrize("format", ["mp3", "opus", "aac", "flac"])
@pytest.mark.parametrize("rate", [44_100, 32_000])
def test_each_slice_fed_gives_decodable_audio_at_once(format, rate):
    encoder = make_encoder(format, rate, streaming=True)
    sent, decoded = encoder.header(), []
    for pcm, last in window_slices(tone(SECONDS), last=True, first=True):
        sent += encoder.feed(pcm, last)
        decoded.append(decode(sent)[2].shape[-1])
    first_slice = FIRST_FEED_SAMPLES * output_rate(format, rate) // contract.SAMPLE_RATE
    # after the first slice (0.25 s) some of it decodes (the codecs keep a few ms of look-ahead), and every slice adds
    assert decoded[0] >= first_slice // 4
    assert all(later > earlier for earlier, later in zip(decoded, decoded[1:]))
    assert decoded[-1] >= int(SECONDS * output_rate(format, rate)) - 2048


def test_window_slices_cover_the_window_once_the_first_slice_short():
    pcm = np.arange(2 * 50_000, dtype=np.float32).reshape(2, -1)
    for first in (False, True):
        for last in (False, True):
            slices = window_slices(pcm, last, first)
            assert np.array_equal(np.concatenate([p for p, _ in slices], axis=-1), pcm)
            assert [flag for _, flag in slices] == [False] * (len(slices) - 1) + [last]
            assert slices[0][0].shape[-1] == (FIRST_FEED_SAMPLES if first else min(FEED_SAMPLES, pcm.shape[-1]))
    assert window_slices(pcm[:, :0], True, True)[0][0].shape[-1] == 0
