"""Audio files and sample-rate conversion: band-limited resampling, 16-bit PCM, .wav/.flac writing."""

from __future__ import annotations

import os
import wave
from pathlib import Path

import numpy as np
import pytest

from music3serve.errors import InputError
from music3serve.serving.audio_io import PcmEncoder, check_output, resample, to_pcm16, write_audio

SOURCE, TARGET = 44_100, 32_000
EDGE = 64  # output samples skipped at each end (the filter reaches 32 source samples, ~23 output samples)


def tone(freq: float, rate: int, samples: int, phase: float = 0.0) -> np.ndarray:
    return np.sin(2 * np.pi * freq * np.arange(samples) / rate + phase)


def out_len(n: int) -> int:
    return -(-n * TARGET // SOURCE)  # ceil(n * 32000 / 44100), in integers


def test_resample_keeps_a_1khz_sine():
    n = SOURCE // 2
    source = np.stack([tone(1000, SOURCE, n), 0.5 * tone(1000, SOURCE, n, phase=1.0)]).astype(np.float32)
    out = resample(source, SOURCE, TARGET)
    assert out.shape == (2, out_len(n)) and out.dtype == np.float32
    expected = np.stack([tone(1000, TARGET, out.shape[-1]), 0.5 * tone(1000, TARGET, out.shape[-1], phase=1.0)])
    error = np.abs(out - expected)[:, EDGE:-EDGE]
    assert error.max() < 1e-3


def test_resample_attenuates_a_20khz_tone():
    # 20 kHz is above the 16 kHz Nyquist of the output; unfiltered it would alias to 12 kHz at full level.
    n = SOURCE // 2
    source = np.stack([tone(20_000, SOURCE, n)] * 2).astype(np.float32)
    out = resample(source, SOURCE, TARGET)[:, EDGE:-EDGE]
    level_db = 20 * np.log10(np.sqrt(np.mean(out**2)) / np.sqrt(np.mean(source**2)))
    assert level_db < -60


@pytest.mark.parametrize("n", [1, 2, 3, 440, 441, 442, 1000, 44_100, 44_101, 100_003])
def test_resample_length(n: int):
    out = resample(np.zeros((2, n), dtype=np.float32), SOURCE, TARGET)
    assert out.shape == (2, out_len(n))


def test_resample_interleaves_its_filter_phases_seamlessly():
    # Each of the filter's phases (320 at 44.1 -> 32 kHz) computes every 320th output: their interleaving must not
    # show over a long input.
    n = 3 * SOURCE
    source = tone(440, SOURCE, n)[None].astype(np.float32)
    out = resample(source, SOURCE, TARGET)
    expected = tone(440, TARGET, out.shape[-1])[None]
    assert out.shape[-1] > 100 * 320
    assert np.abs(out - expected)[:, EDGE:-EDGE].max() < 1e-3


def test_resample_treats_the_signal_as_silent_past_its_end():
    """The last output samples read only the signal's own samples (zeros beyond): the same as resampling it with
    silence appended, cut to its length. The tests above skip the ends; a tail reading past the input was 0.12 off."""
    source = np.random.default_rng(0).uniform(-1, 1, (2, 1000)).astype(np.float32)
    out = resample(source, SOURCE, TARGET)
    padded = resample(np.pad(source, ((0, 0), (0, 882))), SOURCE, TARGET)[..., : out.shape[-1]]
    np.testing.assert_array_equal(out, padded)


def test_resample_identity_when_rates_are_equal():
    source = np.random.default_rng(0).uniform(-1, 1, (2, 1001)).astype(np.float32)
    for rate in (SOURCE, TARGET):
        out = resample(source, rate, rate)
        assert out.shape == source.shape
        np.testing.assert_array_equal(out, source)


def test_to_pcm16_clips_and_rounds():
    left = [0.0, 0.5, 1.0, 1.5, -1.0, -2.0, 0.6 / 32767, -0.6 / 32767, 0.4 / 32767, 100.0 / 32767]
    right = [1.0, -1.0, 0.25, -0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    pcm = to_pcm16(np.array([left, right], dtype=np.float32))
    assert pcm.dtype == np.dtype("<i2")
    assert pcm.shape == (10, 2)  # interleaved: [samples, channels]
    assert pcm[:, 0].tolist() == [0, 16384, 32767, 32767, -32767, -32767, 1, -1, 0, 100]
    assert pcm[:, 1].tolist() == [32767, -32767, 8192, -8192, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("name", ["song.mp3", "song.ogg", "song", "song.wav.txt", "song.wave", ".wav"])
def test_write_audio_rejects_other_suffixes(tmp_path: Path, name: str):
    with pytest.raises(InputError, match=r"NAME\.wav or NAME\.flac") as info:
        write_audio(tmp_path / name, np.zeros((2, 10), dtype=np.float32), SOURCE)
    assert name in str(info.value)
    assert not (tmp_path / name).exists()


def test_an_output_named_as_a_folder_is_refused(tmp_path: Path):
    """`-o out/song.wav/` wrote out/song.wav: Path drops the trailing separator."""
    with pytest.raises(InputError, match="got a folder name"):
        check_output(f"{tmp_path}/song.wav/")
    assert not (tmp_path / "song.wav").exists()
    assert check_output(tmp_path / "song.wav") == tmp_path / "song.wav"


def stereo_noise(samples: int) -> np.ndarray:
    return np.random.default_rng(1).uniform(-1.2, 1.2, (2, samples)).astype(np.float32)


@pytest.mark.parametrize("name", ["song.wav", "SONG.WAV"])
def test_write_wav_round_trip(tmp_path: Path, name: str):
    waveform = stereo_noise(1234)
    path = write_audio(tmp_path / "sub" / "dir" / name, waveform, TARGET)
    assert path == tmp_path / "sub" / "dir" / name
    with wave.open(str(path), "rb") as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()) == (2, 2, TARGET, 1234)
        data = np.frombuffer(f.readframes(1234), dtype="<i2").reshape(-1, 2)
    np.testing.assert_array_equal(data, to_pcm16(waveform))


def test_write_flac_round_trip(tmp_path: Path):
    soundfile = pytest.importorskip("soundfile")  # the audio-file extra: the GPU box lacks it
    waveform = stereo_noise(1234)
    path = write_audio(tmp_path / "song.flac", waveform, SOURCE)
    info = soundfile.info(str(path))
    assert (info.format, info.subtype, info.samplerate, info.channels) == ("FLAC", "PCM_16", SOURCE, 2)
    assert info.frames == 1234
    data, rate = soundfile.read(str(path), dtype="int16")
    assert rate == SOURCE
    np.testing.assert_array_equal(data, to_pcm16(waveform))


def test_a_written_file_gets_the_permissions_open_would_give(tmp_path: Path):
    """Written through a temporary file, but with the usual mode (0o666 less the umask), not a temp file's 0o600."""
    umask = os.umask(0o022)
    try:
        path = write_audio(tmp_path / "song.wav", np.zeros((2, 10), dtype=np.float32), SOURCE)
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["song.wav"]


def test_a_song_named_by_a_symbolic_link_goes_to_the_file_it_points_to(tmp_path: Path):
    (tmp_path / "songs").mkdir()
    real, link = tmp_path / "songs" / "real.wav", tmp_path / "latest.wav"
    real.write_bytes(b"old song")
    link.symlink_to(real)
    waveform = np.zeros((2, 441), dtype=np.float32)
    assert check_output(link) == real
    assert write_audio(link, waveform, 44100) == real
    assert link.is_symlink() and link.resolve() == real
    with wave.open(str(real)) as song:
        assert song.getnframes() == 441
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.wav", "songs"]
    assert [p.name for p in (tmp_path / "songs").iterdir()] == ["real.wav"]


def encoded(encoder: PcmEncoder, waveform: np.ndarray, cuts: list[int]) -> np.ndarray:
    """The encoder's bytes for `waveform` fed in pieces split at `cuts` (the last piece marked last), as int16
    [samples, channels]."""
    pieces = np.split(waveform, cuts, axis=-1)
    data = b"".join(encoder.feed(piece, last=i == len(pieces) - 1) for i, piece in enumerate(pieces))
    return np.frombuffer(data, dtype="<i2").reshape(-1, 2)


def test_the_stream_encoder_clamps_before_it_resamples() -> None:
    """Out-of-range samples are clamped to [-1, 1] and then resampled to 32 kHz, as the offline song is (its
    waveform is in [-1, 1] before the CLI resamples it): clamping only after resampling (which to_pcm16 does anyway)
    lets the overshoot into the filter. Noise in [-2, 2] makes the two orders differ on most output samples."""
    waveform = np.random.default_rng(2).uniform(-2, 2, (2, 3000)).astype(np.float32)
    pcm = encoded(PcmEncoder(TARGET), waveform, [1000, 1700])
    clamped_first = to_pcm16(resample(np.clip(waveform, -1.0, 1.0), SOURCE, TARGET))
    clamped_after = to_pcm16(resample(waveform, SOURCE, TARGET))
    assert np.mean(clamped_after != clamped_first) > 0.5  # the input tells the two orders apart
    np.testing.assert_array_equal(pcm, clamped_first)


@pytest.mark.parametrize("rate", [SOURCE, TARGET])
def test_a_finished_encoder_returns_no_bytes(rate: int) -> None:
    """Once fed its last piece the encoder is finished: a second finish (the API flushes at Done, after a chunk that
    was already last) and a push of more audio both return exactly b"", so nothing more is sent or counted, and its
    state is left alone."""
    encoder = PcmEncoder(rate)
    waveform = stereo_noise(2000) * 0.5
    song = encoded(encoder, waveform, [700])
    assert len(song) == (out_len(2000) if rate == TARGET else 2000)

    def state() -> tuple[int, int] | None:
        return None if encoder.resampler is None else (encoder.resampler.received, encoder.resampler.emitted)

    before = state()
    for piece, last in [(np.zeros((2, 0), np.float32), True), (waveform, False), (waveform, True)]:
        tail = encoder.feed(piece, last)
        assert type(tail) is bytes and tail == b""
    assert state() == before


def test_resample_is_the_filter_applied_output_by_output():
    """Each output is the windowed-sinc filter at its own phase over the 64 source samples around it (zeros past the
    ends), computed here one output at a time in float64."""
    up, down, zeros = 320, 441, 32  # 44.1 -> 32 kHz
    taps = np.arange(-zeros * up, zeros * up + 1)
    cutoff = 0.97 * up / down
    kernel = cutoff * np.sinc(cutoff * taps / up) * np.kaiser(taps.size, 8.6)
    source = np.random.default_rng(3).uniform(-1, 1, (2, 700)).astype(np.float32)
    got = resample(source, SOURCE, TARGET)
    for n in range(got.shape[-1]):
        base, phase = n * down // up, n * down % up
        want = sum(source[:, base + o].astype(np.float64) * kernel[phase - o * up + zeros * up]
                   for o in range(1 - zeros, zeros + 1) if 0 <= base + o < source.shape[-1])
        np.testing.assert_allclose(got[:, n], want, atol=1e-6)
