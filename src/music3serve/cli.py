"""Command line: `music3serve generate ...`, `music3serve serve ...`, `music3serve bench ...` and
`music3serve make-tiny DIR`; main() runs a command once its arguments pass their checks (cli_args.py)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import NoReturn

from .cli_args import ARGUMENT_CHECKS, SERVE_EXTRA, SERVE_PACKAGES, check_port, text_argument
from .cli_parser import build_parser
from .errors import Music3Error, install_hint
from .logs import setup_logging
from .model_location import cache_root, hf_cache_snapshot, resolve_model, tiny_checkpoint
from .serving.audio_io import resample, write_audio

__all__ = ["build_parser", "cache_root", "check_port", "hf_cache_snapshot", "main", "resolve_model", "text_argument",
           "tiny_checkpoint"]

log = logging.getLogger("music3serve")


def run_generate(args: argparse.Namespace) -> None:
    import torch

    from .checkpoint import require_device
    from .pipeline import Pipeline
    from .prompt import encode_prompt
    from .tokenizer import load_tokenizer

    require_device(args.device)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    one_cpu_thread(device)
    root = resolve_model(args.model, args.tiny)
    if (root / "tokenizer" / "tokenizer.json").is_file():  # the prompt's token limit too, before minutes of loading
        encode_prompt(load_tokenizer(root / "tokenizer"), args.caption, args.lyrics)
    log.info("loading model", extra={"path": str(root), "device": device})
    progress = show_progress()
    acoustic = args.acoustic_dtype or "float32"
    pipeline = Pipeline.from_pretrained(root, device=device, acoustic=acoustic, progress=progress,
                                        quantization=args.quantization or "none")
    song = pipeline.generate(args.caption, args.lyrics, args.duration, args.seed, steps=args.steps, progress=progress)
    waveform = resample(song.waveform, song.sample_rate, args.sample_rate)
    path = write_audio(args.output, waveform, args.sample_rate)
    log.info(
        "wrote song",
        extra={"path": str(path), "seconds": waveform.shape[-1] / args.sample_rate, "frames": song.frames,
               "ended_by": song.ended_by, **song.timings},
    )


def run_serve(args: argparse.Namespace) -> None:
    if args.ray:
        return run_serve_on_ray(args)
    try:
        from .serving.server import serve
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in SERVE_PACKAGES:
            raise
        raise Music3Error(f"{SERVE_EXTRA} ({exc}): {install_hint('serve')}") from None
    from .checkpoint import require_device
    from .serving.access import Access, HostPolicy
    from .serving.engine import Engine

    warn_if_open(args)
    access = Access(tuple(args.api_key), tuple(args.allowed_origins), HostPolicy.for_bind(args.host, args.allowed_hosts))
    require_device(args.device)
    one_cpu_thread(args.device)
    root = resolve_model(args.model, args.tiny)
    log.info("loading engine", extra={"path": str(root), "device": args.device or "deploy config",
                                      "config": args.config or "default"})
    engine = Engine.from_pretrained(root, args.deploy, args.device, progress=show_progress())
    try:
        serve(engine, args.host, args.port, args.log_level, access, args.served_model_name)
    finally:
        engine.close()


def run_serve_on_ray(args: argparse.Namespace) -> None:
    try:
        from .serving.ray_app import RayAppArgs, serve_on_ray
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("ray", "fastapi", "starlette", "pydantic", "uvicorn", "h11"):
            raise
        raise Music3Error(f"--ray needs Ray Serve ({exc}): {install_hint('ray')}") from None
    warn_if_open(args)
    given = {name: value for name, value in (("max_queued_songs", args.max_queued_songs), ("replicas", args.replicas))
             if value is not None}
    app = RayAppArgs(model=args.model, tiny=args.tiny, config=args.config, device=args.device,
                     autoscale=args.autoscale, api_keys=args.api_key,
                     allowed_origins=args.allowed_origins, allowed_hosts=args.allowed_hosts, host=args.host,
                     served_model_names=list(args.served_model_name), quantization=args.quantization,
                     acoustic_dtype=args.acoustic_dtype, **given)
    serve_on_ray(app, args.host, args.port)


def warn_if_open(args: argparse.Namespace) -> None:
    """A server reachable from the network (bound to other than loopback) without API keys: said at start."""
    from .serving.access import binds_loopback

    if not args.api_key and not binds_loopback(args.host):
        log.warning("the server listens beyond this machine without API keys: anyone who can reach it may use it (set "
                    "--api-key or MUSIC3_API_KEY, or --host 127.0.0.1)", extra={"host": args.host})


def one_cpu_thread(device: str | None) -> None:
    """A run on the CPU takes one intra-op thread unless OMP_NUM_THREADS says otherwise (the split placement's worker
    process too): the tiny models' small ops gain little from more, and OpenMP's spin-waits beside a core that another
    process keeps busy cost seconds a call."""
    import torch

    if "OMP_NUM_THREADS" in os.environ or (device != "cpu" and torch.cuda.is_available()):
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    log.info("the CPU runs on one thread (set OMP_NUM_THREADS for more)")


def show_progress() -> bool:
    """Progress bars on a terminal only (a log file would get every redraw), and not when asked for quiet logs."""
    return sys.stderr.isatty() and logging.getLogger().isEnabledFor(logging.INFO)


def run_make_tiny(args: argparse.Namespace) -> None:
    target = Path(args.directory)
    if target.exists() and any(target.iterdir()):
        if not (target / "modular_model_index.json").is_file():  # --force or not: never someone's other files
            raise Music3Error(f"{target} holds files and no checkpoint; make-tiny replaces only a checkpoint folder")
        if not args.force:
            raise Music3Error(f"{target} holds a checkpoint; pass --force to replace it")
    from .tiny import write_tiny

    write_tiny(target, seed=args.seed)
    print(f"wrote a tiny random MiniMax-Music3 checkpoint to {target}")


def run_bench(args: argparse.Namespace) -> None:
    import torch

    if not torch.cuda.is_available():
        raise Music3Error("benchmarks need a CUDA device")
    if args.stage == "talker":
        from .bench.talker import run
    elif args.stage == "acoustic":
        from .bench.acoustic import run
    elif args.stage == "e2e":
        from .bench.e2e import run
    elif args.stage == "ready":
        from .bench.ready import run

        print(run())
        return
    else:
        from .bench.acoustic import precision

        print(precision())
        return
    if args.stage == "e2e":
        print(run(placement=args.placement or "colocated", render_batch=args.render_batch,
                  quantization=args.quantization))
    else:
        print(run(peers=not args.no_peers, quantization=args.quantization))


def exit_on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    """SIGTERM (systemd, docker stop) unwinds the program as Ctrl-C does, so what a `finally` cleans up (a staging
    folder, a temporary audio file, the engine) is cleaned up; the exit status stays 128 + 15."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    handlers = {signal.SIGTERM: exit_on_sigterm}
    if args.command == "serve" and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # Started as a script's background job: Ctrl-C (kill -INT) stops the server all the same, as it does once
        # uvicorn runs, and also while the weights load (minutes at full size).
        handlers[signal.SIGINT] = signal.default_int_handler
    on_main_thread = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()} if on_main_thread else {}
    try:
        try:
            ARGUMENT_CHECKS[args.command](args)
            if args.command == "generate":
                run_generate(args)
            elif args.command == "serve":
                run_serve(args)
            elif args.command == "bench":
                run_bench(args)
            else:
                run_make_tiny(args)
        except (Music3Error, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    except KeyboardInterrupt:  # outside the finally too: a Ctrl-C may land while it runs (the command's memory freed)
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:
        if exc.code == 128 + signal.SIGTERM:  # exit_on_sigterm's
            print("terminated", file=sys.stderr)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
