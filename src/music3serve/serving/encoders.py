"""Streaming audio encoders: float32 windows at the model's rate in, the chosen format's bytes out as each window
arrives. WAV and raw PCM are written here; MP3, Opus, AAC and FLAC go through PyAV (FFmpeg's libmp3lame, libopus,
aac and flac encoders; the `serve` extra): MP3 as MPEG audio frames, Opus in Ogg at 48 kHz (the
only rate libopus encodes at full band: the song is resampled to it), AAC in ADTS frames, FLAC as a native FLAC
stream."""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import Music3Error, install_hint
from .audio_io import PcmEncoder, to_pcm16, wav_header

FORMATS = ("wav", "mp3", "flac", "opus", "aac", "pcm")
MEDIA_TYPES = {
    "wav": "audio/wav", "pcm": "application/octet-stream", "mp3": "audio/mpeg", "flac": "audio/flac",
    "opus": "audio/ogg", "aac": "audio/aac",
}
OPUS_RATE = 48_000
DEFAULT_BITRATES = {"mp3": 192_000, "aac": 192_000, "opus": 128_000}  # bits/s of the stereo stream


@dataclass(frozen=True)
class _Codec:
    container: str  # FFmpeg's muxer
    codec: str  # FFmpeg's encoder
    sample_format: str  # what the encoder takes: planar float, interleaved float or interleaved int16
    muxer_options: tuple[tuple[str, str], ...] = ()


_CODECS = {
    "mp3": _Codec("mp3", "libmp3lame", "fltp"),
    # streamed, Ogg pages of 100 ms (FFmpeg's default: 1 s), so Opus leaves slice by slice as the other formats do
    "opus": _Codec("ogg", "libopus", "flt", (("page_duration", "100000"),)),
    "aac": _Codec("adts", "aac", "fltp"),
    "flac": _Codec("flac", "flac", "s16"),  # the same int16 samples as WAV, so it decodes to them bit for bit
}


def output_rate(format: str, sample_rate: int) -> int:
    """The rate the encoded audio has: the one asked for, but 48 kHz for Opus."""
    return OPUS_RATE if format == "opus" else sample_rate


def make_encoder(format: str, sample_rate: int, streaming: bool, bitrate: int | None = None) -> PcmEncoder:
    """The encoder of one song's audio. streaming: bytes leave window by window (WAV with an open-ended header);
    else the whole file comes at the end (WAV, FLAC and MP3 headers then say the length)."""
    if format == "pcm":
        return PcmEncoder(sample_rate)
    if format == "wav":
        return WavEncoder(sample_rate, streaming)
    return AvEncoder(format, output_rate(format, sample_rate), streaming, bitrate or DEFAULT_BITRATES.get(format))


class WavEncoder(PcmEncoder):
    """16-bit stereo WAV: a streamed file's header says its sizes are unknown (0xFFFFFFFF); a whole one's are exact."""

    def __init__(self, sample_rate: int, streaming: bool):
        super().__init__(sample_rate)
        self.streaming = streaming

    def header(self) -> bytes:
        return wav_header(self.sample_rate) if self.streaming else b""

    def whole_header(self, size: int) -> bytes:
        return b"" if self.streaming else wav_header(self.sample_rate, size)


class _Sink:
    """A write-only, unseekable file for PyAV's muxer: what it wrote since the last `take`."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self.parts)
        self.parts.clear()
        return data


def _av():
    try:
        import av
    except ImportError as exc:
        raise Music3Error(f"mp3, opus, aac and flac need PyAV ({exc}): {install_hint('serve')}") from None
    return av


class AvEncoder(PcmEncoder):
    """One song through an FFmpeg encoder and muxer. Streamed, each window's packets leave as soon as they are
    muxed (the encoder keeps its look-ahead, a few ms, until the next window or the end); whole, the file is
    written into memory and comes at the end, its header completed (FLAC's sample count, MP3's Xing frame)."""

    def __init__(self, format: str, sample_rate: int, streaming: bool, bitrate: int | None):
        super().__init__(sample_rate)
        av, spec = _av(), _CODECS[format]
        self.av, self.spec, self.streaming = av, spec, streaming
        self.file: _Sink | io.BytesIO = _Sink() if streaming else io.BytesIO()
        options = dict(spec.muxer_options) if streaming else {}
        self.container = av.open(self.file, "w", format=spec.container, options=options)
        self.stream = self.container.add_stream(spec.codec, rate=sample_rate, layout="stereo")
        if bitrate is not None and format != "flac":
            self.stream.bit_rate = bitrate
        self.pts = 0
        # feed runs on a worker thread; close may come from the event loop while it does (a request task cancelled
        # at shutdown): FFmpeg's contexts are not to be used from two threads at once.
        self.lock = threading.Lock()

    def feed(self, pcm: np.ndarray, last: bool) -> bytes:
        with self.lock:
            return self._feed(pcm, last)

    def _feed(self, pcm: np.ndarray, last: bool) -> bytes:
        if self.finished:
            return b""
        samples = self.samples(pcm, last)
        if samples.shape[-1]:
            self._mux(self.stream.encode(self._frame(samples)))
        if last:
            self._mux(self.stream.encode(None))  # flush the encoder's look-ahead
            self.container.close()  # the trailer (and, in memory, the completed header)
        if self.streaming:
            return self.file.take()
        return self.file.getvalue() if last else b""

    def _frame(self, samples: np.ndarray):
        fmt = self.spec.sample_format
        if fmt == "fltp":
            array = np.ascontiguousarray(np.clip(samples, -1.0, 1.0), dtype=np.float32)
        elif fmt == "flt":
            array = np.clip(samples, -1.0, 1.0).T.astype(np.float32).reshape(1, -1)
        else:
            array = to_pcm16(samples).reshape(1, -1)
        frame = self.av.AudioFrame.from_ndarray(array, format=fmt, layout="stereo")
        frame.sample_rate, frame.pts = self.sample_rate, self.pts
        self.pts += samples.shape[-1]
        return frame

    def _mux(self, packets) -> None:
        for packet in packets:
            self.container.mux(packet)

    def close(self) -> None:
        with self.lock:
            if not self.finished:
                self.finished = True
                self.container.close()

