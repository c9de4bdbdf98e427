"""Audio files and sample-rate conversion (no server-only imports; soundfile only for FLAC)."""

from __future__ import annotations

import functools
import math
import os
import struct
import uuid
import wave
from fractions import Fraction
from pathlib import Path

import numpy as np

from .. import contract
from ..errors import InputError, install_hint

CHANNELS = 2
OUTPUT_RATES = (44_100, 32_000)
UNKNOWN_SIZE = 0xFFFFFFFF  # RIFF and data sizes of a streaming WAV, whose length is not known yet
FILE_SUFFIXES = (".wav", ".flac")  # of the song files write_audio writes
FILTER_ZEROS = 32  # the resampling filter's zero crossings per side: source samples each output reads either way


def resample(waveform: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """Band-limited polyphase resampling of [channels, samples] with a Kaiser-windowed sinc filter."""
    if source_rate == target_rate:
        return waveform
    up, down, bank = _filter_bank(source_rate, target_rate)
    zeros, length = FILTER_ZEROS, waveform.shape[-1]
    out_len = math.ceil(length * up / down)
    # Output n reads source samples n * down // up + (1 - zeros .. zeros), zeros past the ends: with the source
    # padded by zeros - 1 before, it reads padded window n * down // up.
    padded = np.pad(waveform, [(0, 0)] * (waveform.ndim - 1) + [(zeros - 1, zeros)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * zeros, axis=-1)
    out = np.empty(waveform.shape[:-1] + (out_len,), dtype=np.float32)
    for first in range(min(up, out_len)):  # outputs first, first + up, ...: one filter phase, windows `down` apart
        position = first * down
        count = len(range(first, out_len, up))
        taken = windows[..., position // up :: down, :][..., :count, :]
        out[..., first::up] = (taken * bank[position % up]).sum(-1)
    return out


@functools.lru_cache(maxsize=8)
def _filter_bank(source_rate: int, target_rate: int) -> tuple[int, int, np.ndarray]:
    """(up, down, [up phases, 2 * zeros taps]) of the resampling filter from one rate to the other."""
    ratio = Fraction(target_rate, source_rate)
    up, down, zeros = ratio.numerator, ratio.denominator, FILTER_ZEROS
    cutoff = min(1.0, float(ratio)) * 0.97  # of the source Nyquist, with a little room for the transition band
    taps = np.arange(-zeros * up, zeros * up + 1)
    kernel = cutoff * np.sinc(cutoff * taps / up) * np.kaiser(taps.size, 8.6)
    offsets = np.arange(-zeros + 1, zeros + 1)
    return up, down, kernel[np.arange(up)[:, None] - offsets[None, :] * up + zeros * up]


def to_pcm16(waveform: np.ndarray) -> np.ndarray:
    """[channels, samples] float in [-1, 1] -> interleaved int16 [samples, channels]."""
    return (np.clip(waveform, -1.0, 1.0).T * 32767.0).round().astype("<i2")


def check_output(path: Path | str) -> Path:
    """Fail now, before any model work, if `path` cannot take the song: its name (see `_song_name`), and a real
    file created (then removed) in its folder, or, where the folder is still to be made, a writable folder to make
    it in (made only when the song is written, so a failed run leaves no folders behind)."""
    path = _song_name(path)
    try:
        _check_name_length(path, _nearest_existing(path.parent))
        path = _through_link(path)
        folder = _nearest_existing(path.parent)
        if not folder.is_dir():
            raise InputError(f"cannot write {path}: {folder} is not a folder")
        if folder == path.parent:
            handle, temporary = _create_temporary(path)
            os.close(handle)
            temporary.unlink()
        elif not os.access(folder, os.W_OK | os.X_OK):
            raise InputError(f"cannot write {path}: no permission to make folders in {folder}")
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def _nearest_existing(folder: Path) -> Path:
    """`folder`, or its nearest parent that exists (as a folder, a file or a link)."""
    return next(p for p in (folder, *folder.parents) if os.path.lexists(p) or p == p.parent)


def _through_link(path: Path) -> Path:
    """Where a song named by a symbolic link goes: the file the link points to (written as `cp` would write it; the
    rename that puts the song in place would otherwise replace the link itself)."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _song_name(path: Path | str) -> Path:
    """`path` checked as a song file: NAME.wav or NAME.flac (with the package .flac needs), not a folder (nor named
    as one, with a trailing separator: Path would drop it)."""
    if str(path).endswith(("/", os.sep)):
        raise InputError(f"output file must be NAME.wav or NAME.flac, got a folder name {str(path)!r}")
    path = Path(path)
    try:
        is_folder = path.is_dir()
    except OSError:  # a name too long to look up, a folder we may not search: check_output and the write say so
        is_folder = False
    if is_folder:
        raise InputError(f"cannot write {path}: it is a folder (give the song's file name, NAME.wav or NAME.flac)")
    if path.suffix.lower() not in FILE_SUFFIXES or not path.stem:
        raise InputError(f"output file must be NAME.wav or NAME.flac, got {path.name!r}")
    if path.suffix.lower() == ".flac":
        _soundfile()
    return path


def _name_max(folder: Path) -> int:
    """The file system's limit on a name's bytes in `folder` (255 where it cannot be read)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def _check_name_length(path: Path, folder: Path) -> None:
    """path's name within NAME_MAX of `folder`, the nearest existing folder."""
    limit = _name_max(folder)
    if len(os.fsencode(path.name)) > limit:
        raise InputError(f"output file name is too long: {len(os.fsencode(path.name))} bytes, the limit is {limit}")


def _create_temporary(path: Path) -> tuple[int, Path]:
    """A new hidden file beside `path` (a fd open for writing), created as open() would create `path` (mode 0o666
    less the umask; mkstemp's files are 0o600); its name keeps as much of path's name as leaves room for its own
    19 bytes, so it fits wherever path's does."""
    keep = min(200, _name_max(path.parent) - 19)
    stem = os.fsencode(path.name)[:keep].decode(errors="ignore")
    temporary = path.parent / f".{stem}.{uuid.uuid4().hex[:12]}.part"
    return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), temporary


def write_audio(path: Path | str, waveform: np.ndarray, sample_rate: int) -> Path:
    """Write 16-bit PCM .wav (standard library) or .flac (soundfile) of a [channels, samples] waveform, whole or
    not at all: into a temporary file beside it, renamed over `path` once complete (a failed write, say a full
    disk, leaves no partial file and keeps what was there)."""
    path = _song_name(path)
    kind = path.suffix.lower()
    pcm = to_pcm16(waveform)
    try:
        path = _through_link(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = _create_temporary(path)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with open(handle, "wb") as file:
            if kind == ".wav":
                with wave.open(file, "wb") as out:
                    out.setnchannels(pcm.shape[1])
                    out.setsampwidth(2)
                    out.setframerate(sample_rate)
                    out.writeframes(pcm.tobytes())
            else:
                _soundfile().write(file, pcm, sample_rate, subtype="PCM_16", format="FLAC")
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def _soundfile():
    try:
        import soundfile
    except ImportError as exc:
        raise InputError(f"writing .flac needs the soundfile package: {install_hint('audio')}") from exc
    return soundfile


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """A 44-byte stereo PCM16 WAV header; without `data_bytes` the sizes read 0xFFFFFFFF (unknown, for streaming)."""
    data = UNKNOWN_SIZE if data_bytes is None else data_bytes
    riff = UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    block = CHANNELS * 2
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI", b"RIFF", riff, b"WAVE", b"fmt ", 16, 1, CHANNELS, sample_rate,
        sample_rate * block, block, 16, b"data", data,
    )


class StreamResampler:
    """`audio_io.resample` of a stream fed piece by piece, equal to resampling the whole stream at once.

    Output n reads source samples up to floor(n * down / up) + zeros, so it is emitted once those have arrived
    (the last piece flushes the rest against zeros, as the whole-stream call does). The kept source starts on a
    multiple of `down`, where the output grid meets the source grid, so every piece is resampled with exactly
    the context and filter phases the whole-stream call would have used: no gaps or clicks between windows."""

    def __init__(self, source_rate: int, target_rate: int):
        ratio = Fraction(target_rate, source_rate)
        self.rates, self.zeros = (source_rate, target_rate), FILTER_ZEROS
        self.up, self.down = ratio.numerator, ratio.denominator
        self.kept: np.ndarray | None = None  # source samples from index `start` on
        self.start = self.received = self.emitted = 0

    def feed(self, piece: np.ndarray, last: bool) -> np.ndarray:
        piece = piece.astype(np.float32, copy=False)
        self.kept = piece if self.kept is None else np.concatenate([self.kept, piece], axis=-1)
        self.received += piece.shape[-1]
        up, down = self.up, self.down
        complete = self.received if last else self.received - self.zeros  # source the outputs may read up to
        ready = max(0, math.ceil(complete * up / down))
        if ready <= self.emitted:
            return np.zeros(self.kept.shape[:-1] + (0,), np.float32)
        first = self.start * up // down  # output index of the kept source's first sample (exact: start % down == 0)
        out = resample(self.kept, *self.rates)[..., self.emitted - first : ready - first]
        self.emitted = ready
        needed = ready * down // up - self.zeros + 1  # first source sample the next output reads
        start = max(self.start, needed // down * down)
        self.kept, self.start = self.kept[..., start - self.start :], start
        return out


class PcmEncoder:
    """Float windows at the model rate -> interleaved s16le bytes at the output rate. The base of every streaming
    encoder (serving/encoders.py): `samples` gives the clamped, resampled float samples the others encode."""

    def __init__(self, sample_rate: int):
        same = sample_rate == contract.SAMPLE_RATE
        self.sample_rate = sample_rate
        self.resampler = None if same else StreamResampler(contract.SAMPLE_RATE, sample_rate)
        self.finished = False
        self.samples_out = 0  # per channel, at the output rate, encoded so far

    def samples(self, pcm: np.ndarray, last: bool) -> np.ndarray:
        """[2, n] float32 at the output rate, ready to encode (none once the last window has been fed)."""
        if self.finished:
            return np.zeros((CHANNELS, 0), np.float32)
        self.finished = last
        pcm = np.clip(pcm, -1.0, 1.0)  # as the offline waveform is clamped before it is resampled
        if self.resampler is not None:
            pcm = self.resampler.feed(pcm, last)
        self.samples_out += pcm.shape[-1]
        return pcm

    def feed(self, pcm: np.ndarray, last: bool) -> bytes:
        return to_pcm16(self.samples(pcm, last)).tobytes()

    def header(self) -> bytes:
        """What a stream starts with, before the first window's bytes."""
        return b""

    def whole_header(self, size: int) -> bytes:
        """What the bytes `feed` returned (`size` of them) follow in a whole (not streamed) response's file."""
        return b""

    def close(self) -> None:
        """Free what the encoder holds (a song cut short never feeds its last window)."""
