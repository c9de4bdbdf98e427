"""The streaming encoders alone: every lossy format gives decodable audio for each half-second slice as it is fed,
so a song's first audio leaves after one slice's encoding (not after a muxer's page or buffer fills)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("av")

from music3serve import contract
from music3serve.serving.encoders import make_encoder, output_rate
from music3serve.serving.song_feed import window_slices
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
    for pcm, last in window_slices(tone(SECONDS), last=True):
        sent += encoder.feed(pcm, last)
        decoded.append(decode(sent)[2].shape[-1])
    slice_samples = output_rate(format, rate) // 2
    # after the first slice at least half of it decodes (the codecs keep a few ms of look-ahead), and every slice adds
    assert decoded[0] >= slice_samples // 2
    assert all(later > earlier for earlier, later in zip(decoded, decoded[1:]))
    assert decoded[-1] >= int(SECONDS * output_rate(format, rate)) - 2048
