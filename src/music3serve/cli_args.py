"""The command line's argument types and per-command checks: all run before torch or the engine is imported (that
takes seconds), so that a mistake is answered at once."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import socket
from pathlib import Path
from typing import Callable

from . import contract
from .cli_access import env_api_keys
from .errors import Music3Error, install_hint
from .pdl_setting import pdl_mode
from .prompt import MAX_CAPTION_CHARS, MAX_LYRICS_CHARS, check_seed, check_steps, check_text, frames_for_duration
from .serving.audio_io import check_output
from .serving.deploy_config import load_deploy_config, with_quantization, with_stage1_dtype

SERVE_PACKAGES = ("fastapi", "starlette", "pydantic", "uvicorn", "h11")  # the serve extra and what fastapi brings
SERVE_EXTRA = "serving needs fastapi and uvicorn"
MAX_MODEL_NAME_CHARS = 256


def text_argument(field: str, limit: int) -> Callable[[str], str]:
    """argparse type of a text argument of at most `limit` characters: the text itself, or a file's as @path."""

    def read(value: str) -> str:
        if not value.startswith("@"):
            if any("\udc80" <= c <= "\udcff" for c in value):  # bytes the command line could not decode as UTF-8
                raise argparse.ArgumentTypeError("not valid UTF-8: the shell passed text in another encoding (e.g. "
                                                 "Latin-1); use UTF-8, or @FILE with UTF-8 text")
            return value
        if value == "@":  # Path("") is the current folder: "cannot read ." would not say what went wrong
            raise argparse.ArgumentTypeError(f"@ needs a file name after it: @{field}.txt reads the {field} from "
                                             f"{field}.txt")
        path = Path(value[1:])
        try:
            # utf-8-sig: a byte-order mark (Windows editors write one) is no part of the text; bounded: past the
            # longest allowed text the rest is not needed.
            with open(path, encoding="utf-8-sig") as file:
                text = file.read(limit + 1)
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{path} is not UTF-8 text (it holds the byte "
                                             f"{exc.object[exc.start]:#04x}): save it as UTF-8") from exc
        if len(text) > limit:
            raise argparse.ArgumentTypeError(f"{path} holds more than {limit} characters, the longest {field} allowed")
        return text

    return read


def _integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None


def positive_int(value: str) -> int:
    """An integer of at least 1."""
    number = _integer(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def port_number(value: str) -> int:
    """A TCP port, 0 to 65535 (0: any free port)."""
    port = _integer(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0 to 65535)")
    return port


def replica_range(value: str) -> tuple[int, int]:
    """MIN:MAX engine replicas, 1 <= MIN <= MAX (`serve --ray --autoscale`, a Ray Serve config file's `autoscale`)."""
    low, _, high = value.partition(":")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise ValueError(f"MIN:MAX replicas with 1 <= MIN <= MAX, got {value!r}")
    return int(low), int(high)


def argument(check: Callable[[str], object]) -> Callable[[str], str]:
    """argparse type of a text argument that `check` accepts (its ValueError is the argument's error)."""

    def read(value: str) -> str:
        try:
            check(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return read


def comma_list(check: Callable[[str], str]) -> Callable[[str], list[str]]:
    """argparse type of a repeatable option that also takes comma-separated values, each checked by `check`."""

    def read(value: str) -> list[str]:
        items = [item.strip() for item in value.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError("names nothing (an empty list)")
        return [check(item) for item in items]

    return read


def at_least(low: int) -> Callable[[str], int]:
    """argparse type of an integer >= low."""

    def read(value: str) -> int:
        if not (value.isdigit() and int(value) >= low):
            raise argparse.ArgumentTypeError(f"an integer >= {low}, got {value!r}")
        return int(value)

    return read


# Argument checks: each command's run only after its check, and no check imports torch or the engine (importing
# them takes seconds), so that a mistake is answered at once. A new flag's check goes into its command's function.
def check_precision_flags(args: argparse.Namespace) -> None:
    """--quantization fp8 runs stage 1 on bf16 activations: an explicit --acoustic-dtype float32 asks otherwise."""
    if args.quantization == "fp8" and args.acoustic_dtype == "float32":
        raise Music3Error("--quantization fp8 runs stage 1 on bf16 activations: drop --acoustic-dtype float32, or "
                          "use --quantization none for a float32 stage 1")


def check_generate(args: argparse.Namespace) -> None:
    check_output(args.output)
    check_precision_flags(args)
    # The pipeline checks these again; here they fail before anything loads.
    frames_for_duration(args.duration)
    check_seed(args.seed)
    check_steps(args.steps)
    check_text("caption", args.caption, MAX_CAPTION_CHARS)
    check_text("lyrics", args.lyrics, MAX_LYRICS_CHARS)
    check_runtime(args)


def check_serve(args: argparse.Namespace) -> None:
    ray_only = [f"--{n.replace('_', '-')}" for n in ("replicas", "autoscale", "max_queued_songs")
                if getattr(args, n) is not None]
    if ray_only and not args.ray:
        raise Music3Error(f"{', '.join(ray_only)} {'apply' if len(ray_only) > 1 else 'applies'} to `serve --ray` only")
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise Music3Error(f"{SERVE_EXTRA} (missing: {', '.join(missing)}): {install_hint('serve')}")
    if args.ray and importlib.util.find_spec("ray") is None:
        raise Music3Error(f"--ray needs Ray Serve (missing: ray): {install_hint('ray')}")
    args.api_key = args.api_key or env_api_keys()
    args.served_model_name = served_model_names(args.served_model_name)
    args.deploy = load_deploy_config(args.config)
    check_precision_flags(args)
    if args.quantization is not None:
        args.deploy = with_quantization(args.deploy, args.quantization)
    if args.acoustic_dtype is not None:
        args.deploy = with_stage1_dtype(args.deploy, args.acoustic_dtype)
    if not (args.ray and os.environ.get("RAY_ADDRESS")):  # else the cluster's proxy listens, not this host
        check_port(args.host, args.port)
    check_runtime(args)


def check_runtime(args: argparse.Namespace) -> None:
    """What generate and serve share: a --model that names a folder, and the environment's settings."""
    if args.model == "":
        raise Music3Error("--model is an empty path: name the checkpoint folder, or leave --model out (MUSIC3_MODEL, "
                          "else the Hugging Face cache)")
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is not None and not re.fullmatch(r"\s*[1-9][0-9]*\s*(,\s*[1-9][0-9]*\s*)*", threads):
        # OpenMP ignores it with a warning of its own and takes every core
        raise Music3Error(f"OMP_NUM_THREADS={threads!r:.40} is not a number of threads: set it to one (say 4), or "
                          "unset it for one thread on the CPU")
    pdl_mode()


def served_model_names(names: list[str] | None) -> tuple[str, ...]:
    """--served-model-name: the names given (each once), else the model's own two."""
    for name in names or ():
        if not name.strip() or len(name) > MAX_MODEL_NAME_CHARS:
            raise Music3Error(f"--served-model-name must be a name of 1 to {MAX_MODEL_NAME_CHARS} characters, "
                              f"got {name!r:.80}")
    return tuple(dict.fromkeys(names or contract.SERVED_MODEL_NAMES))


def check_bench(args: argparse.Namespace) -> None:
    if args.stage != "e2e" and (args.placement is not None or args.render_batch is not None):
        raise Music3Error(f"--placement and --render-batch apply to `bench e2e` only, not `bench {args.stage}`")


def check_make_tiny(args: argparse.Namespace) -> None:
    check_seed(args.seed)
    if not args.directory:
        raise Music3Error("the folder to write is an empty path; name one (say ./tiny)")
    target = Path(args.directory)
    if target.exists() and not target.is_dir():
        raise Music3Error(f"{target} is a file; make-tiny writes a folder (remove the file or pick another path)")


ARGUMENT_CHECKS: dict[str, Callable[[argparse.Namespace], None]] = {
    "generate": check_generate, "serve": check_serve, "bench": check_bench, "make-tiny": check_make_tiny,
}


def check_port(host: str, port: int) -> None:
    """Fail before the engine loads (minutes for the real checkpoint) if the server could not listen there."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # IPv6 hosts too, as uvicorn binds them
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        raise Music3Error(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
