"""What the audio formats cost: each streaming encoder's time per 4 s window (serving/encoders.py, on the CPU, as the
server runs it), and time to first audio through each endpoint at concurrency 1 and 8, against raw PCM.

On the GPU box (full-size random weights): `PYTHONPATH=src python3 bench/encoders.py`
On a CPU (tiny checkpoint, a smoke run):  `PYTHONPATH=src python3 bench/encoders.py --tiny`

Time to first audio is from sending the request to the first byte of audio (after a WAV header; for events, the
first delta); each request is closed once its first audio has come, which cancels its song, and the next starts once
the engine holds no song; the endpoints take turns, `--repeats` times each (median and max). The window period is
the time between the first and the second window's audio at concurrency 1: what one window costs the pipeline.

What encoding adds to time to first audio is measured directly too: the ms from a new song's first window to its
first encoded bytes (one song, and as many at once as the concurrency, on threads as the server runs them), as a share
of /v1/audio/speech's raw PCM median time to first audio. Identical requests' times to first audio spread by more
than that."""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from music3serve import contract
from music3serve.acoustic.windows import song_windows
from music3serve.bench.common import table
from music3serve.serving.audio_io import PcmEncoder
from music3serve.serving.encoders import FORMATS, make_encoder, output_rate
from music3serve.serving.song_feed import window_slices

AUDIO_EVENT = re.compile(rb'"audio":"[^"]')  # an event with audio in it (speech's base64, music's hex)
WINDOW_S = (5.0, 4.0)  # the first window's audio, then each further one's
LYRICS = "[verse]\nCity lights are fading slow\n[chorus]\nHold on, hold on"
PATHS = {"songs": "/v1/songs", "speech": "/v1/audio/speech", "music": "/v1/music_generation"}
ENDPOINTS = {  # name: (endpoint, body fields, how the first audio shows)
    "songs pcm 44.1k": ("songs", {"format": "pcm"}, "bytes"),
    "songs wav 44.1k": ("songs", {"format": "wav"}, "wav"),
    "speech wav 32k": ("speech", {"response_format": "wav", "stream": True}, "wav"),
    "speech pcm 32k": ("speech", {"response_format": "pcm", "stream": True}, "bytes"),
    "speech mp3 32k": ("speech", {"response_format": "mp3", "stream": True}, "bytes"),
    "speech opus 48k": ("speech", {"response_format": "opus", "stream": True}, "bytes"),
    "speech aac 32k": ("speech", {"response_format": "aac", "stream": True}, "bytes"),
    "speech flac 32k": ("speech", {"response_format": "flac", "stream": True}, "bytes"),
    "speech sse mp3 32k": ("speech", {"response_format": "mp3", "stream_format": "sse"}, "event"),
    "music mp3 44.1k": ("music", {"stream": True}, "event"),
}


def music_like(seconds: float, seed: int = 0) -> np.ndarray:
    """[2, samples] float32: a few drifting partials and noise at -20 dB, as hard to encode as real music."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * contract.SAMPLE_RATE)) / contract.SAMPLE_RATE
    tones = sum(0.1 * np.sin(2 * np.pi * f * t * (1 + 0.01 * np.sin(t)) + p)
                for f, p in zip(rng.uniform(80, 4000, 8), rng.uniform(0, 6, 8)))
    noise = rng.normal(0, 0.1, (2, t.size))
    return (np.stack([tones, np.roll(tones, 300)]) + noise).astype(np.float32)


def first_bytes_ms(fmt: str, rate: int, songs: int = 1) -> float:
    """Wall ms from a song's first window reaching a new encoder to its first encoded bytes, fed as the server feeds
    it (serving/song_feed.window_slices), for `songs` songs at once on threads of their own as the server runs them
    (the slowest): what encoding adds to time to first audio."""

    def first_bytes(encoder: PcmEncoder, pcm: np.ndarray) -> float:
        start = time.perf_counter()
        for piece, last in window_slices(pcm, last=False, first=True):
            if encoder.feed(piece, last):
                break
        return (time.perf_counter() - start) * 1000

    encoders = [make_encoder(fmt, rate, streaming=True) for _ in range(songs)]
    for encoder in encoders:
        encoder.header()
    pcm = [music_like(WINDOW_S[0], seed=i) for i in range(songs)]
    with ThreadPoolExecutor(songs) as pool:
        elapsed = max(pool.map(first_bytes, encoders, pcm))
    for encoder in encoders:
        encoder.close()
    return elapsed


def encode_costs(windows: int, concurrency: tuple[int, ...]) -> tuple[list[list], dict[tuple[str, int, int], float]]:
    """Per format and rate: median and largest CPU ms per 4 s window, streamed, over `windows` windows; and the median
    ms to a new song's first bytes for each number of songs at once (first_bytes_ms), also returned by (format, rate,
    songs)."""
    rows, first = [], {}
    for rate in (44_100, 32_000):
        for fmt in FORMATS:
            encoder, costs = make_encoder(fmt, rate, streaming=True), []
            encoder.header()
            for index in range(windows):
                pcm = music_like(WINDOW_S[index > 0], seed=index)
                start = time.thread_time()  # the CPU time of the encoding thread, whatever else runs
                encoder.feed(pcm, index == windows - 1)
                costs.append((time.thread_time() - start) * 1000 * 4.0 / WINDOW_S[index > 0])
            for n in concurrency:
                first[fmt, rate, n] = statistics.median(first_bytes_ms(fmt, rate, n) for _ in range(windows))
            rows.append([fmt, rate, f"{statistics.median(costs):.1f}", f"{max(costs):.1f}",
                         *(f"{first[fmt, rate, n]:.1f}" for n in concurrency)])
    return rows, first


def encoding_shares(first: dict[tuple[str, int, int], float], times: dict[tuple[str, int], list[float]],
                    concurrency: tuple[int, ...]) -> list[list]:
    """Per format as /v1/audio/speech serves it by default (32 kHz; Opus 48 kHz): its ms to first bytes as a share of
    that endpoint's raw PCM median time to first audio at each concurrency (what encoding moves time to first audio
    by)."""
    pcm = {n: statistics.median(times["speech pcm 32k", n]) for n in concurrency}
    def share(fmt: str, n: int) -> str:
        return f"{first[fmt, 32_000, n]:.1f} ms = {first[fmt, 32_000, n] / 10 / pcm[n]:.2f}%"

    return [[fmt, output_rate(fmt, 32_000), *(share(fmt, n) for n in concurrency)]
            for fmt in ("wav", "flac", "mp3", "opus", "aac")]


async def first_audio(client, url: str, body: dict, shows: str) -> float:
    """Seconds from the request to its first audio; the response is closed then (its song is cancelled)."""
    start, seen = time.perf_counter(), b""
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for piece in response.aiter_bytes():
            seen += piece
            if len(seen) > {"bytes": 0, "wav": 44}.get(shows, 0) and (shows != "event" or AUDIO_EVENT.search(seen)):
                return time.perf_counter() - start
    raise RuntimeError(f"{url}: no audio")


async def window_period(client, url: str, body: dict, frames: int) -> float | None:
    """Seconds between the first window's audio and the second's, for raw 16-bit stereo PCM at 44.1 kHz from a song of
    `frames` frames (None: one window)."""
    first_window = song_windows(frames)[0].samples * 4  # 5.004 s: 220672 samples
    got, first = 0, None
    async with client.stream("POST", url, json=body) as response:
        async for piece in response.aiter_bytes():
            got += len(piece)
            if first is None:
                first = time.perf_counter()
            if got > first_window:
                return time.perf_counter() - first
    return None


async def idle(client, timeout: float = 60.0) -> None:
    """Until the engine holds no song (the songs of closed requests are cancelled, not gone at once)."""
    deadline = time.perf_counter() + timeout
    while not re.search(r"^music3_songs_held 0(\.0)?$", (await client.get("/metrics")).text, re.MULTILINE):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the engine still holds songs {timeout:g} s after their requests were closed")
        await asyncio.sleep(0.02)


async def endpoint_rows(base: str, seconds: float, steps: int | None, concurrency: tuple[int, ...],
                        repeats: int) -> tuple[list, dict[tuple[str, int], list[float]], float | None]:
    import httpx

    frames = int(seconds * contract.FRAME_RATE)
    common = {"songs": {"caption": "pop song", "lyrics": LYRICS, "duration": seconds},
              "speech": {"model": "MiniMax-Music3", "input": LYRICS, "instructions": "pop song",
                         "max_new_tokens": frames},
              "music": {"model": "MiniMax-Music3", "prompt": "pop song", "lyrics": LYRICS, "max_new_tokens": frames}}
    rows = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        songs = {**common["songs"], "format": "pcm", "seed": 0, **({"steps": steps} if steps else {})}
        period = await window_period(client, "/v1/songs", songs, frames)
        times = {(name, n): [] for name in ENDPOINTS for n in concurrency}
        for _ in range(repeats):  # the endpoints interleaved, each started on an idle engine
            for name, (kind, extra, shows) in ENDPOINTS.items():
                for n in concurrency:
                    bodies = [{**common[kind], **extra, "seed": i, **({"steps": steps} if steps else {})}
                              for i in range(n)]
                    await idle(client)
                    times[name, n] += await asyncio.gather(*(first_audio(client, PATHS[kind], b, shows)
                                                             for b in bodies))
                    slowest = max(times[name, n][-n:])
                    print(f"{name} c={n}: first audio {slowest:.3f} s (slowest of the burst)", flush=True)
        for name in ENDPOINTS:
            rows.append([name] + [f"{f(times[name, n]):.3f}" for n in concurrency for f in (statistics.median, max)])
    return rows, times, period


def serve_in_thread(engine) -> tuple[str, object, threading.Thread]:
    import uvicorn

    from music3serve.serving.api import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def make_engine(tiny: bool, folder: Path):
    from music3serve.serving.engine import Engine

    if tiny:
        from music3serve.tiny import write_tiny_checkpoint

        return Engine.from_pretrained(write_tiny_checkpoint(folder / "tiny", seed=0), device="cpu")
    from music3serve.bench.e2e import random_models
    from music3serve.serving.deploy_config import load_deploy_config, with_stage1_dtype

    # stage 1 in bf16, as `music3serve bench e2e` measures it
    return Engine(random_models("cuda"), with_stage1_dtype(load_deploy_config(), "bfloat16"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU (a smoke run)")
    parser.add_argument("--windows", type=int, default=8, help="windows per format for the encode cost")
    parser.add_argument("--seconds", type=float, default=20.0, help="song length asked for (the --tiny default: 10)")
    parser.add_argument("--repeats", type=int, default=3, help="requests per endpoint and concurrency, interleaved")
    args = parser.parse_args()
    seconds = 10.0 if args.tiny and args.seconds == parser.get_default("seconds") else args.seconds
    steps = 2 if args.tiny else None
    concurrency = (1, 2) if args.tiny else (1, 8)
    costs, first = encode_costs(args.windows, concurrency)
    print(table(["format", "rate", "median CPU ms / 4 s window", "max",
                 *(f"median ms to first bytes, {n} at once" for n in concurrency)], costs), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        engine = make_engine(args.tiny, Path(folder))
        try:
            base, server, thread = serve_in_thread(engine)
            rows, times, period = asyncio.run(endpoint_rows(base, seconds, steps, concurrency, args.repeats))
            server.should_exit = True  # the songs of closed requests end first (cancelled), then the engine closes
            thread.join(60)
        finally:
            engine.close()
    heads = ["endpoint"] + [f"{what} c={n} (s)" for n in concurrency for what in ("median TTFA", "max")]
    print(table(heads, rows))
    if period is not None:
        print(f"window period at concurrency 1 (first to second window's audio): {period * 1000:.0f} ms")
    print(table(["format", "rate", *(f"to first bytes, share of speech pcm's median TTFA, c={n}" for n in concurrency)],
                encoding_shares(first, times, concurrency)))


if __name__ == "__main__":
    main()
