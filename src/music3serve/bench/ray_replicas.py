"""Ray Serve replicas on one host (docs/scaling.md): the aggregate real-time factor of 8 x N concurrent songs through
Ray's HTTP proxy for N = 1, 2, 4, 8 replicas of one GPU each (as many as the GPUs allow), and time to first audio
p50/p95, against the plain server over one engine in the same run; then the split placement (stage 1 on a second
GPU): one 20 s song and eight 30 s songs. Full-size random weights, as `music3serve bench e2e`.

    python -m music3serve.bench.ray_replicas [--replicas 1,2,4,8] [--json FILE]
    python -m music3serve.bench.ray_replicas --tiny     # dry run on the CPU: the tiny checkpoint, short songs

Replica counts go up in one application (Ray adds replicas; those running stay warm). bench/ray_replicas.sh runs it
on the GPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np

from ..serving.ray_app import APP_NAME, EngineArgs, RayAppArgs, build, engine_for, on_ray
from .common import table

CAPTION, LYRICS = "pop song, 120 bpm", "[verse]\nCity lights are fading slow\n[chorus]\nHold on, hold on"
BYTES_PER_SECOND = 44100 * 2 * 2  # pcm: 16-bit stereo at 44.1 kHz
# As `bench e2e`: stage 1 in bf16. Split: stage 1 on the replica's second GPU.
DEPLOY = "stages:\n  - stage_id: 0\n    devices: \"0\"\n  - stage_id: 1\n    dtype: bfloat16\n    devices: \"{stage1}\"\n"
HEADERS = ["run", "replicas", "GPUs each", "songs", "audio s", "wall s", "x real time", "vs N x one",
           "first audio p50 s", "first audio p95 s"]


async def one_song(client: httpx.AsyncClient, seed: int, duration: float) -> dict[str, float]:
    started, first, size = time.perf_counter(), None, 0
    song = {"caption": CAPTION, "lyrics": LYRICS, "duration": duration, "seed": seed, "format": "pcm"}
    async with client.stream("POST", "/v1/songs", json=song) as response:
        if response.status_code != 200:
            raise RuntimeError(f"song {seed}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for piece in response.aiter_raw():
            first = time.perf_counter() - started if first is None else first
            size += len(piece)
    return {"first_audio_s": first, "total_s": time.perf_counter() - started, "audio_s": size / BYTES_PER_SECOND}


async def burst(url: str, durations: list[float]) -> tuple[list[dict[str, float]], float]:
    """Every song at once; their results and the wall time until the last ended."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0, connect=10.0), limits=limits) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_song(client, seed, d) for seed, d in enumerate(durations)))
    return list(results), time.perf_counter() - started


def row(run: str, replicas: int, gpus: int, durations: list[float], url: str, one: float | None) -> list[Any]:
    results, wall = asyncio.run(burst(url, durations))
    audio = sum(r["audio_s"] for r in results)
    first = [r["first_audio_s"] for r in results]
    rate = audio / wall
    scaling = rate / (replicas * one) if one else 1.0
    out = [run, replicas, gpus, len(results), audio, wall, rate, scaling, float(np.percentile(first, 50)),
           float(np.percentile(first, 95))]
    print(table(HEADERS, [out]), flush=True)
    return out


@contextlib.contextmanager
def plain_server(args: EngineArgs) -> Iterator[str]:
    """`music3serve serve`'s app over one engine built as a replica builds it, under uvicorn on 127.0.0.1."""
    import uvicorn

    from ..serving.api import create_app

    engine = engine_for(args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        engine.close()


def run(replica_counts: list[int], songs_per_replica: int, duration: float, tiny: bool, split: bool,
        port: int, folder: Path) -> list[list[Any]]:
    """The table's rows. Ray is started here unless one is running (or RAY_ADDRESS names a cluster)."""
    from ray import serve

    configs = {name: folder / f"{name}.yaml" for name in ("colocated", "split")}
    for name, stage1 in (("colocated", 0), ("split", 1)):
        configs[name].write_text(DEPLOY.format(stage1=stage1))
    if tiny:  # on the CPU both stages share the process whatever `devices` say: the default config, one for both
        configs["colocated"].write_text("{}")
        configs["split"] = configs["colocated"]
    base = {"tiny": True, "device": "cpu"} if tiny else {"random_weights": True}
    gpus = 0 if tiny else 1
    warm = [1.0] * 2  # compiles the prefill shapes

    with plain_server(EngineArgs(config=str(configs["colocated"]), **base)) as url:
        row("warm-up", 1, gpus, warm, url, None)
        rows = [row("plain server", 1, gpus, [duration] * songs_per_replica, url, None)]
    url, one = f"http://127.0.0.1:{port}", None
    with on_ray("127.0.0.1", port):
        for replicas in sorted(replica_counts):
            serve.run(build(RayAppArgs(config=str(configs["colocated"]), replicas=replicas, **base)), name=APP_NAME)
            row("warm-up", replicas, gpus, warm * replicas, url, None)
            rows.append(row("Ray", replicas, gpus, [duration] * songs_per_replica * replicas, url, one))
            one = one or rows[-1][6]
        if split:
            serve.run(build(RayAppArgs(config=str(configs["split"]), replicas=1, **base)), name=APP_NAME)
            row("warm-up", 1, 2 * gpus, warm, url, None)
            split_songs = ([duration], [duration] * songs_per_replica) if tiny else ([20.0], [30.0] * 8)
            rows += [row("Ray, split", 1, 2 * gpus, songs, url, None) for songs in split_songs]
    return rows


def main(argv: list[str] | None = None) -> list[list[Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="dry run: the tiny checkpoint on the CPU, short songs")
    parser.add_argument("--replicas", default=None, help="replica counts, e.g. 1,2,4 (default: 1, 2, 4, 8 up to the "
                                                         "GPUs; --tiny: 1,2)")
    parser.add_argument("--songs-per-replica", type=int, default=None, help="default 8 (--tiny: 2)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per song (default 30; --tiny: 2)")
    parser.add_argument("--no-split", action="store_true", help="skip the split placement (it needs two GPUs)")
    parser.add_argument("--port", type=int, default=8000, help="Ray's HTTP proxy on 127.0.0.1 (default 8000)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if args.tiny:
        gpus = 8  # none is used: as many replicas as asked run on the CPU
    else:
        import torch

        gpus = torch.cuda.device_count()
    counts = [int(n) for n in args.replicas.split(",")] if args.replicas else [1, 2] if args.tiny else [
        n for n in (1, 2, 4, 8) if n <= gpus]
    if not counts or max(counts) > gpus or min(counts) < 1:
        parser.error(f"replica counts {counts}: each replica takes one GPU, and this machine has {gpus}")
    split = not args.no_split and gpus >= 2
    with tempfile.TemporaryDirectory() as folder:
        rows = run(counts, args.songs_per_replica or (2 if args.tiny else 8), args.duration or (2.0 if args.tiny else 30.0),
                   args.tiny, split, args.port, Path(folder))
    print(f"\n{time.strftime('%Y-%m-%d')}: {'tiny checkpoint, CPU' if args.tiny else 'full-size random weights'}\n")
    print(table(HEADERS, rows))
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(HEADERS, r)) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
