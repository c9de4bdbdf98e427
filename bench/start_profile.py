"""Where the engine's start goes (full-size random weights, empty compile caches): seconds of each warm-up part, every
Triton compile in this process by kernel (ours; inductor compiles its own in worker processes), and dynamo's and
inductor's compile totals. docs/performance.md, "Time to ready".

    PYTHONPATH=src python3 bench/start_profile.py [bfloat16|fp8|float32]
"""

from __future__ import annotations

import os
import sys
import tempfile

CACHE = tempfile.mkdtemp(prefix="music3serve-start-")  # empty caches, as a new replica's: set before torch loads
os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"] = f"{CACHE}/inductor", f"{CACHE}/triton"

import functools  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import triton.compiler  # noqa: E402
from torch._dynamo.utils import compile_times  # noqa: E402

from music3serve.acoustic.renderer import Renderer  # noqa: E402
from music3serve.bench.e2e import random_models  # noqa: E402
from music3serve.bench.ready import deploy_for  # noqa: E402
from music3serve.serving.engine import Engine  # noqa: E402
from music3serve.talker.engine import Talker  # noqa: E402
from music3serve.talker.step import FrameStep  # noqa: E402

PARTS = [(FrameStep, "warm_up"), (FrameStep, "run_eager"), (FrameStep, "capture"), (Talker, "warm_prefill"),
         (Renderer, "warmup")]
COMPILE_TOTALS = ("compile_inner", "call_user_compiler", "fx_codegen_and_compile", "bytecode_tracing")


def timing(fn: Callable, spans: list[tuple[str, str, float]]) -> Callable:
    """fn, its seconds (to the end of its GPU work, outside a capture) appended to spans with its int argument."""

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize()
            size = next((str(a) for a in args[1:] if isinstance(a, int)), "")
            spans.append((fn.__qualname__, size, time.perf_counter() - started))

    return timed


def counting(compile_fn: Callable, compiles: dict[str, list[float]]) -> Callable:
    """triton.compile, each call's seconds kept under its kernel's name."""

    @functools.wraps(compile_fn)
    def counted(src: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return compile_fn(src, *args, **kwargs)
        finally:
            compiles[getattr(getattr(src, "fn", None), "__name__", type(src).__name__)].append(
                time.perf_counter() - started)

    return counted


def main(precision: str) -> None:
    spans: list[tuple[str, str, float]] = []
    compiles: dict[str, list[float]] = defaultdict(list)
    for owner, name in PARTS:
        setattr(owner, name, timing(getattr(owner, name), spans))
    triton.compiler.compile = counting(triton.compiler.compile, compiles)  # where triton.jit looks it up
    models = random_models("cuda", quantize=precision == "fp8")
    torch.cuda.synchronize()
    started = time.perf_counter()
    engine = Engine(models, deploy_for(precision))
    print(f"{precision}: ready in {time.perf_counter() - started:.1f} s, by stage {engine.ready_s}")
    for name, size, seconds in spans:
        print(f"  {name:22s} {size:>4s} {seconds:7.2f} s")
    print("Triton compiles in this process (kernel, count, seconds):")
    for name, times in sorted(compiles.items(), key=lambda item: -sum(item[1])):
        print(f"  {name:32s} {len(times):3d} {sum(times):7.2f} s")
    totals = compile_times(repr="str", aggregate=True).splitlines()
    print("\n".join(line for line in totals if line.split() and line.split()[0].endswith(COMPILE_TOTALS)))
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fp8")
