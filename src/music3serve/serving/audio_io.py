"""Audio files and sample-rate conversion (no server-only imports; soundfile only for FLAC)."""

from __future__ import annotations

import math
import wave
from fractions import Fraction
from pathlib import Path

import numpy as np

from ..errors import InputError

OUTPUT_RATES = (44_100, 32_000)
FORMATS = (".wav", ".flac")


def resample(
    waveform: np.ndarray, source_rate: int, target_rate: int, zeros: int = 32, block: int = 1 << 15
) -> np.ndarray:
    """Band-limited polyphase resampling of [channels, samples] with a Kaiser-windowed sinc filter."""
    if source_rate == target_rate:
        return waveform
    ratio = Fraction(target_rate, source_rate)
    up, down = ratio.numerator, ratio.denominator
    cutoff = min(1.0, float(ratio)) * 0.97  # of the source Nyquist, with a little room for the transition band
    taps = np.arange(-zeros * up, zeros * up + 1)
    kernel = cutoff * np.sinc(cutoff * taps / up) * np.kaiser(taps.size, 8.6)
    out_len = math.ceil(waveform.shape[-1] * up / down)
    offsets = np.arange(-zeros + 1, zeros + 1)
    out = np.empty(waveform.shape[:-1] + (out_len,), dtype=np.float32)
    for first in range(0, out_len, block):  # blocks bound the [samples, taps] gather
        positions = np.arange(first, min(first + block, out_len)) * down  # on the upsampled grid
        base, phase = positions // up, positions % up
        index = base[:, None] + offsets[None, :]
        weights = kernel[phase[:, None] - offsets[None, :] * up + zeros * up]
        valid = (index >= 0) & (index < waveform.shape[-1])
        gathered = np.where(valid, waveform[..., np.clip(index, 0, waveform.shape[-1] - 1)], 0.0)
        out[..., first : first + len(positions)] = (gathered * weights).sum(-1)
    return out


def to_pcm16(waveform: np.ndarray) -> np.ndarray:
    """[channels, samples] float in [-1, 1] -> interleaved int16 [samples, channels]."""
    return (np.clip(waveform, -1.0, 1.0).T * 32767.0).round().astype("<i2")


def write_audio(path: Path | str, waveform: np.ndarray, sample_rate: int) -> Path:
    """Write 16-bit PCM .wav (standard library) or .flac (soundfile) of a [channels, samples] waveform."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise InputError(f"output file must end in {' or '.join(FORMATS)}, got {path.name!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = to_pcm16(waveform)
    if suffix == ".wav":
        with wave.open(str(path), "wb") as out:
            out.setnchannels(pcm.shape[1])
            out.setsampwidth(2)
            out.setframerate(sample_rate)
            out.writeframes(pcm.tobytes())
        return path
    try:
        import soundfile
    except ImportError as exc:
        raise InputError("writing .flac needs the soundfile package: pip install 'music3serve[audio]'") from exc
    soundfile.write(str(path), pcm, sample_rate, subtype="PCM_16")
    return path
