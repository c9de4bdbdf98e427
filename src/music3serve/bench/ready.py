"""`music3serve bench ready`: seconds from loaded weights to a ready engine, per precision, and the first song after.

The colocated engine of the default deploy file on full-size random weights, stage 1 in float32, bfloat16 and fp8
(`quantization: fp8`, both stages). Each precision starts in a process of its own with empty inductor and Triton
caches, as a new replica on a new machine does: nothing compiled by an earlier run is reused (--warm: then once more
on the caches the first start filled, as a restart on the same machine does).

    python -m music3serve.bench.ready [float32] [bfloat16] [fp8] [--warm] [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..errors import Music3Error
from ..logs import setup_logging
from ..serving.deploy_config import DeployConfig, load_deploy_config, with_quantization, with_stage1_dtype
from .common import compiled_graphs, table

# precision: (stage 1 dtype, quantization of both stages)
PRECISIONS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "fp8": ("bfloat16", "fp8")}
SONG_S = 10.0  # the first song after ready: two windows, the first a full-length one (a captured graph)
RESULT = "ready result: "  # the line a child process reports on


def deploy_for(precision: str) -> DeployConfig:
    """The default deploy file with stage 1 in `precision`."""
    if precision not in PRECISIONS:
        raise Music3Error(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    dtype, quantization = PRECISIONS[precision]
    return with_stage1_dtype(with_quantization(load_deploy_config(), quantization), dtype)


def measure(precision: str, checkpoint: Path | None = None) -> dict[str, float]:
    """In this process: build the engine, then one SONG_S song; seconds to ready (whole and per part) and the song's.
    Full-size random weights on CUDA, or a checkpoint's (on the CPU without CUDA) once loaded."""
    from ..checkpoint import load_models
    from ..serving.engine import Engine
    from .e2e import random_models, song

    deploy = deploy_for(precision)
    quantization = deploy.stages[0].quantization
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if checkpoint is None and device == "cpu":
        raise Music3Error("bench ready on random full-size weights needs a CUDA device (or give --checkpoint)")
    models = (random_models(device, quantize=quantization == "fp8") if checkpoint is None
              else load_models(checkpoint, device, quantization=quantization))
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    engine = Engine(models, deploy)
    ready = time.perf_counter() - started
    graphs_at_ready = compiled_graphs()
    try:
        first = asyncio.run(song(engine, SONG_S, 0))
    finally:
        engine.close()
    return {"ready_s": ready, **{f"{part}_s": s for part, s in engine.ready_s.items()},
            "first_audio_s": first["first_audio_s"], "song_s": first["total_s"],
            "graphs_at_ready": graphs_at_ready, "graphs_in_song": compiled_graphs() - graphs_at_ready}


def measure_in_fresh_process(precision: str, cache: str, checkpoint: Path | None = None) -> dict[str, float]:
    """measure() in a child process whose inductor and Triton caches live in `cache`; its log goes to this process's
    stderr, its printout to stdout."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    where = [] if checkpoint is None else ["--checkpoint", str(checkpoint)]
    child = subprocess.run([sys.executable, "-m", "music3serve.bench.ready", "--one", precision, *where], env=env,
                           stdout=subprocess.PIPE, text=True, check=False)
    lines = child.stdout.splitlines()
    print("\n".join(line for line in lines if not line.startswith(RESULT)), flush=True)
    results = [line.removeprefix(RESULT) for line in lines if line.startswith(RESULT)]
    if child.returncode != 0 or not results:
        raise Music3Error(f"the {precision} run failed (exit status {child.returncode}; its log is above)")
    return json.loads(results[-1])


def run(precisions: list[str] | None = None, checkpoint: Path | None = None, warm: bool = False) -> str:
    """Every precision in a fresh process on empty compile caches, one after another (warm: then a second start on
    the caches the first one filled, as a restart on the same machine); the table of their times."""
    precisions = precisions or list(PRECISIONS)
    for precision in precisions:
        deploy_for(precision)  # a bad name fails before the first run, not after it
    headers = ["stage 1 precision", "compile caches", "ready s", "talker s", "renderer s",
               f"first audio s ({SONG_S:g} s song)", "song s", "graphs compiled by ready / in the song"]
    rows = []
    for precision in precisions:
        with tempfile.TemporaryDirectory(prefix="music3serve-ready-") as cache:
            for caches in ["empty", "of the start before"][: 1 + warm]:
                r = measure_in_fresh_process(precision, cache, checkpoint)
                rows.append([precision, caches, r["ready_s"], r["talker_s"], r["renderer_s"], r["first_audio_s"],
                             r["song_s"], f"{r['graphs_at_ready']} / {r['graphs_in_song']}"])
                print(table(headers, rows[-1:]), flush=True)
    weights = "full-size random weights" if checkpoint is None else f"the checkpoint {checkpoint}"
    return (f"colocated engine of the default deploy file, {weights} (ready: from weights on the device), each start "
            f"in a process of its own; {time.strftime('%Y-%m-%d', time.gmtime())}\n\n" + table(headers, rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("precisions", nargs="*", help=f"any of {', '.join(PRECISIONS)} (default: all, in this order)")
    parser.add_argument("--checkpoint", type=Path, help="this checkpoint's weights instead of random full-size ones")
    parser.add_argument("--warm", action="store_true",
                        help="also a second start per precision on the compile caches the first one filled")
    parser.add_argument("--one", choices=list(PRECISIONS), help="measure this one in this process (a child's job)")
    args = parser.parse_args(argv)
    if args.one:
        setup_logging()  # the engine's start-up lines (stage precision, engine ready) on stderr
        print(RESULT + json.dumps(measure(args.one, args.checkpoint)), flush=True)
    else:
        print(run(args.precisions, args.checkpoint, args.warm))


if __name__ == "__main__":
    main()
