"""Audio bodies decoded back with PyAV (an independent decoder: FFmpeg's), for the tests of the song endpoints."""

from __future__ import annotations

import io
import math

import av
import numpy as np

from music3serve import contract
from music3serve.acoustic.windows import song_samples

CODEC_SLACK = {"mp3": 2 * 1152, "aac": 2 * 1024}  # encoder delay and the last frame's padding, where not trimmed


def decode(body: bytes) -> tuple[int, int, np.ndarray]:
    """(sample rate, channels, float32 [channels, samples]) of an encoded file, or of a prefix of one."""
    with av.open(io.BytesIO(body)) as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray() for frame in container.decode(stream)]
        rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
    pcm = np.concatenate(frames, axis=-1) if frames else np.zeros((channels, 0), np.float32)
    if pcm.dtype == np.int16:
        pcm = pcm.astype(np.float32) / 32767.0
    if pcm.shape[0] == 1 and channels > 1:  # interleaved (packed) samples
        pcm = pcm.reshape(-1, channels).T
    return rate, channels, pcm


def expected_samples(frames: int, rate: int) -> int:
    """Samples per channel of a song of `frames` frames at `rate`."""
    return math.ceil(song_samples(frames) * rate / contract.SAMPLE_RATE)


def assert_song_audio(body: bytes, format: str, rate: int, frames: int) -> np.ndarray:
    """The body decodes to stereo at `rate` with the song's length (codecs' padding aside); its samples."""
    if format == "pcm":
        pcm = np.frombuffer(body, "<i2").reshape(-1, 2).T.astype(np.float32) / 32767.0
        got_rate, channels = rate, 2
    else:
        got_rate, channels, pcm = decode(body)
    assert (got_rate, channels) == (rate, 2)
    want = expected_samples(frames, rate)
    assert want <= pcm.shape[-1] <= want + CODEC_SLACK.get(format, 0), (format, pcm.shape, want)
    return pcm
