"""The same request and seed give the same bytes in a fresh process, colocated and split (stage 1 in a worker process):
nothing of a song depends on the process, its start or the placement. One song alone: each render call then holds
one window of it in either placement (several songs at once batch differently, tests/test_split.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A fresh process: the engine on the tiny checkpoint, one song, its 16-bit PCM's digest printed.
SONG = textwrap.dedent("""
    import asyncio, hashlib, sys
    import numpy as np
    from music3serve.serving.audio_io import to_pcm16
    from music3serve.serving.engine import Engine
    from music3serve.serving.events import AudioChunk, Failed, SongRequest

    async def pcm(engine):
        chunks = []
        async for event in engine.submit(SongRequest("synth pop, 120 bpm", "[verse]\\nla la", 9.0, seed=41, steps=2)):
            if isinstance(event, Failed):
                sys.exit(event.message)
            if isinstance(event, AudioChunk):
                chunks.append(event.pcm)
        return np.concatenate(chunks, axis=-1)

    with Engine.from_pretrained(sys.argv[1], device="cpu", split=sys.argv[2] == "split") as engine:
        song = asyncio.run(pcm(engine))
    print(song.shape[-1], hashlib.sha256(to_pcm16(song).tobytes()).hexdigest())
""")


def song_in_a_fresh_process(tiny_dir: Path, placement: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", SONG, str(tiny_dir), placement], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()


def test_a_request_and_seed_give_the_same_bytes_in_fresh_processes_colocated_and_split(tiny_dir):
    first = song_in_a_fresh_process(tiny_dir, "colocated")
    samples = int(first.split()[0])
    assert samples > 9 * 44_100 * 0.9, first
    assert song_in_a_fresh_process(tiny_dir, "colocated") == first
    assert song_in_a_fresh_process(tiny_dir, "split") == first
