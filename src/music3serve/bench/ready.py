"""`music3serve bench ready`: seconds from loaded weights to a ready engine, per precision, and the first song after.

The colocated engine of the default deploy file on full-size random weights, stage 1 in float32, bfloat16 and fp8
(`quantization: fp8`, both stages). Each precision starts in a process of its own with empty inductor and Triton
caches, as a new replica on a new machine does: nothing compiled by an earlier run is reused (--warm: then once more
on the caches the first start filled, as a restart on the same machine does). After the first song, two songs at once
and a song beside another's prefill: a graph or one of our Triton kernels compiled after ready (in any of these)
stalls live songs, and is named.

    python -m music3serve.bench.ready [float32] [bfloat16] [fp8] [--warm] [--checkpoint DIR [--fuse]]

--fuse: on the CPU, compile the hot paths with inductor as the engine does on CUDA (C++ code generation: minutes).
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
from typing import TYPE_CHECKING, Any

import torch

from .. import contract
from ..errors import Music3Error
from ..logs import setup_logging
from ..models.fusion import enable_fusion, graphs_per_function
from ..serving.deploy_config import DeployConfig, load_deploy_config, with_quantization, with_stage1_dtype
from .common import KernelCompiles, compiled_graphs, table

if TYPE_CHECKING:
    from ..serving.engine import Engine

# precision: (stage 1 dtype, quantization of both stages)
PRECISIONS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "fp8": ("bfloat16", "fp8")}
SONG_S = 10.0  # the first song after ready: two windows, the first a full-length one (a captured graph)
SHORT_S = 6.0  # a song of one short window
RESULT = "ready result: "  # the line a child process reports on


def deploy_for(precision: str) -> DeployConfig:
    """The default deploy file with stage 1 in `precision`."""
    if precision not in PRECISIONS:
        raise Music3Error(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    dtype, quantization = PRECISIONS[precision]
    return with_stage1_dtype(with_quantization(load_deploy_config(), quantization), dtype)


def measure(precision: str, checkpoint: Path | None = None, cpu_fusion: str | None = None,
            steps: int = contract.DIT_STEPS) -> dict[str, Any]:
    """In this process: build the engine, then the songs after ready; seconds to ready (whole and per part), the first
    song's, the graphs compiled by ready and after it (with the functions they came from), and our Triton kernels
    compiled by ready and after it (by kernel: one compiled after ready stalls the songs playing). Full-size random
    weights on CUDA, or a checkpoint's (on the CPU without CUDA) once loaded, the talker in the deploy file's dtype.
    cpu_fusion: on the CPU, enable fusion with this torch.compile backend first (CUDA engines fuse by themselves).
    steps: each song's Euler steps (fewer: quicker songs, the same shapes)."""
    from ..checkpoint import load_models
    from ..serving.engine import Engine
    from .e2e import random_models

    deploy = deploy_for(precision)
    talker = deploy.stages[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if checkpoint is None and device == "cpu":
        raise Music3Error("bench ready on random full-size weights needs a CUDA device (or give --checkpoint)")
    models = (random_models(device, quantize=talker.quantization == "fp8") if checkpoint is None else
              load_models(checkpoint, device, getattr(torch, talker.dtype), quantization=talker.quantization))
    if device == "cpu" and cpu_fusion:
        enable_fusion(backend=cpu_fusion)
    if device == "cuda":
        torch.cuda.synchronize()
    kernels = KernelCompiles()
    kernels.watch()
    started = time.perf_counter()
    engine = Engine(models, deploy)
    ready = time.perf_counter() - started
    graphs_at_ready, functions, kernels_at_ready = compiled_graphs(), graphs_per_function(), len(kernels.names)
    try:
        first = asyncio.run(songs_after_ready(engine, steps))
    finally:
        engine.close()
    compiled = {name: n - functions.get(name, 0) for name, n in graphs_per_function().items()
                if n != functions.get(name, 0)}
    return {"ready_s": ready, **{f"{part}_s": s for part, s in engine.ready_s.items()},
            "first_audio_s": first["first_audio_s"], "song_s": first["total_s"],
            "graphs_at_ready": graphs_at_ready, "graphs_in_song": compiled_graphs() - graphs_at_ready,
            "compiled_by_ready": functions, "compiled_in_song": compiled,
            "kernels_by_ready": kernels.since(0, kernels_at_ready),
            "kernels_in_song": kernels.since(kernels_at_ready)}


async def songs_after_ready(engine: Engine, steps: int) -> dict[str, float]:
    """The first song (SONG_S: a full window, then a shorter one), then two at once (one of SHORT_S: a short first
    window), then a song submitted while another decodes (its prompt prefilled between that one's frame steps). The
    first song's times."""
    from .e2e import song

    first = await song(engine, SONG_S, 0, steps)
    await asyncio.gather(song(engine, SONG_S, 1, steps), song(engine, SHORT_S, 2, steps))
    decoding = asyncio.create_task(song(engine, SONG_S, 3, steps))
    frames = engine.talker.frames_written
    while engine.talker.frames_written == frames and not decoding.done():
        await asyncio.sleep(0.01)
    await song(engine, SHORT_S, 4, steps)
    await decoding
    return first


def by_ready_and_after(by_ready: int, after: int, named_after: dict[str, int]) -> str:
    """A table cell: compiled by ready / after it, and what came after, by name."""
    names = ", ".join(f"{name} {n}" for name, n in named_after.items())
    return f"{by_ready} / {after}" + (f" ({names})" if names else "")


def measure_in_fresh_process(precision: str, cache: str, checkpoint: Path | None = None, fuse: bool = False
                              ) -> dict[str, Any]:
    """measure() in a child process whose inductor and Triton caches live in `cache`; its log goes to this process's
    stderr, its printout to stdout. fuse: on the CPU, with inductor as on CUDA."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    where = ([] if checkpoint is None else ["--checkpoint", str(checkpoint)]) + (["--fuse"] if fuse else [])
    child = subprocess.run([sys.executable, "-m", "music3serve.bench.ready", "--one", precision, *where], env=env,
                           stdout=subprocess.PIPE, text=True, check=False)
    lines = child.stdout.splitlines()
    print("\n".join(line for line in lines if not line.startswith(RESULT)), flush=True)
    results = [line.removeprefix(RESULT) for line in lines if line.startswith(RESULT)]
    if child.returncode != 0 or not results:
        raise Music3Error(f"the {precision} run failed (exit status {child.returncode}; its log is above)")
    return json.loads(results[-1])


def run(precisions: list[str] | None = None, checkpoint: Path | None = None, warm: bool = False, fuse: bool = False
        ) -> str:
    """Every precision in a fresh process on empty compile caches, one after another (warm: then a second start on
    the caches the first one filled, as a restart on the same machine); the table of their times."""
    precisions = precisions or list(PRECISIONS)
    for precision in precisions:
        deploy_for(precision)  # a bad name fails before the first run, not after it
    headers = ["stage 1 precision", "compile caches", "ready s", "talker s", "renderer s",
               f"first audio s ({SONG_S:g} s song)", "song s", "graphs compiled by ready / after (by function)",
               "our Triton kernels compiled or loaded by ready / after (by kernel)"]
    rows = []
    for precision in precisions:
        with tempfile.TemporaryDirectory(prefix="music3serve-ready-") as cache:
            for caches in ["empty", "of the start before"][: 1 + warm]:
                r = measure_in_fresh_process(precision, cache, checkpoint, fuse)
                graphs = by_ready_and_after(r["graphs_at_ready"], r["graphs_in_song"], r["compiled_in_song"])
                kernels = by_ready_and_after(sum(r["kernels_by_ready"].values()), sum(r["kernels_in_song"].values()),
                                             r["kernels_in_song"])
                rows.append([precision, caches, r["ready_s"], r["talker_s"], r["renderer_s"], r["first_audio_s"],
                             r["song_s"], graphs, kernels])
                print(table(headers, rows[-1:]), flush=True)
                for what, counts in (("graphs", "compiled_by_ready"), ("our Triton kernels", "kernels_by_ready")):
                    print(f"{what} by ready: " + ", ".join(f"{name} {n}" for name, n in sorted(r[counts].items())),
                          flush=True)
    weights = "full-size random weights" if checkpoint is None else f"the checkpoint {checkpoint}"
    weights += ", hot paths compiled by inductor on the CPU" if fuse and checkpoint is not None else ""
    return (f"colocated engine of the default deploy file, {weights} (ready: from weights on the device), each start "
            f"in a process of its own; {time.strftime('%Y-%m-%d', time.gmtime())}\n\n" + table(headers, rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("precisions", nargs="*", help=f"any of {', '.join(PRECISIONS)} (default: all, in this order)")
    parser.add_argument("--checkpoint", type=Path, help="this checkpoint's weights instead of random full-size ones")
    parser.add_argument("--warm", action="store_true",
                        help="also a second start per precision on the compile caches the first one filled")
    parser.add_argument("--fuse", action="store_true",
                        help="on the CPU, compile the hot paths with inductor as CUDA engines do (slow: C++ code)")
    parser.add_argument("--one", choices=list(PRECISIONS), help="measure this one in this process (a child's job)")
    args = parser.parse_args(argv)
    if args.one:
        setup_logging()  # the engine's start-up lines (stage precision, engine ready) on stderr
        result = measure(args.one, args.checkpoint, "inductor" if args.fuse else None)
        print(RESULT + json.dumps(result), flush=True)
    else:
        print(run(args.precisions, args.checkpoint, args.warm, args.fuse))


if __name__ == "__main__":
    main()
