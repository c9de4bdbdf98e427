"""Command line: `music3serve generate ...`, `music3serve serve ...`, `music3serve bench ...` and
`music3serve make-tiny DIR`."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Callable, NoReturn

from . import contract
from .errors import Music3Error
from .logs import setup_logging
from .pdl_setting import pdl_mode
from .prompt import MAX_CAPTION_CHARS, MAX_LYRICS_CHARS, check_seed, check_steps, check_text, frames_for_duration
from .serving.audio_io import OUTPUT_RATES, check_output, resample, write_audio
from .serving.deploy_config import load_deploy_config, with_quantization

log = logging.getLogger("music3serve")

REPO_ID = "MiniMaxAI/MiniMax-Music3"
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
SERVE_PACKAGES = ("fastapi", "starlette", "pydantic", "uvicorn", "h11")  # the serve extra and what fastapi brings
SERVE_EXTRA = "serving needs fastapi and uvicorn"
MAX_MODEL_NAME_CHARS = 256
GET_MODEL = (
    "no MiniMax-Music3 checkpoint found. Download it (57 GB) with\n"
    f"  hf download {REPO_ID}\n"
    "(huggingface-cli download on huggingface_hub before 1.0)\n"
    "then run again, or pass --model DIR, or set MUSIC3_MODEL=DIR, or try the pipeline on random weights with --tiny"
)


def xdg_cache() -> Path:
    """The user's cache folder: $XDG_CACHE_HOME, else ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def cache_root() -> Path:
    return xdg_cache() / "music3serve"


def tiny_checkpoint() -> Path:
    """The tiny random checkpoint in the cache folder, written on first use."""
    target = cache_root() / "tiny-v1"
    if not (target / "modular_model_index.json").is_file():
        from .tiny import write_tiny

        log.info("writing the tiny checkpoint", extra={"path": str(target)})
        write_tiny(target, replace=False)
    return target


def hf_cache_snapshot() -> Path | None:
    """The newest snapshot of the checkpoint in the local Hugging Face cache, if any."""
    # Where huggingface_hub puts it: HF_HUB_CACHE, its old name HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub,
    # where HF_HOME defaults to $XDG_CACHE_HOME/huggingface (then ~/.cache/huggingface).
    home = os.environ.get("HF_HOME") or xdg_cache() / "huggingface"
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or Path(home) / "hub"
    hub = Path(os.path.expandvars(os.path.expanduser(str(hub))))
    snapshots = hub / f"models--{REPO_ID.replace('/', '--')}" / "snapshots"
    found = [p for p in snapshots.glob("*") if (p / "modular_model_index.json").is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_model(model: str | None, tiny: bool) -> Path:
    if tiny:
        return tiny_checkpoint()
    if model:
        return Path(model)
    if os.environ.get("MUSIC3_MODEL"):
        return Path(os.environ["MUSIC3_MODEL"])
    snapshot = hf_cache_snapshot()
    if snapshot is None:
        raise Music3Error(GET_MODEL)
    return snapshot


def text_argument(field: str, limit: int) -> Callable[[str], str]:
    """argparse type of a text argument of at most `limit` characters: the text itself, or a file's as @path."""

    def read(value: str) -> str:
        if not value.startswith("@"):
            if any("\udc80" <= c <= "\udcff" for c in value):  # bytes the command line could not decode as UTF-8
                raise argparse.ArgumentTypeError("not valid UTF-8: the shell passed text in another encoding (e.g. "
                                                 "Latin-1); use UTF-8, or @FILE with UTF-8 text")
            return value
        path = Path(value[1:])
        try:
            # utf-8-sig: a byte-order mark (Windows editors write one) is no part of the text; bounded: past the
            # longest allowed text the rest is not needed.
            with open(path, encoding="utf-8-sig") as file:
                text = file.read(limit + 1)
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from exc
        if len(text) > limit:
            raise argparse.ArgumentTypeError(f"{path} holds more than {limit} characters, the longest {field} allowed")
        return text

    return read


def positive_int(value: str) -> int:
    """An integer of at least 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def port_number(value: str) -> int:
    """A TCP port, 0 to 65535 (0: any free port)."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
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


def api_key(value: str) -> str:
    """An API key: printable ASCII without spaces or commas (it travels in an HTTP header; commas separate keys)."""
    if not value or not all("!" <= c <= "~" for c in value) or "," in value:
        raise argparse.ArgumentTypeError("an API key is printable ASCII without spaces or commas")
    return value


def origin(value: str) -> str:
    """A browser origin as browsers send it (scheme://host[:port], no path), or * for any."""
    value = value.rstrip("/")
    scheme, sep, rest = value.partition("://")
    if value != "*" and not (sep and scheme.isascii() and scheme.isalpha() and rest
                             and not any(c in rest for c in "/?# ")):
        raise argparse.ArgumentTypeError(f"{value!r} is not an origin: scheme://host[:port] (say "
                                         "https://app.example.com or http://localhost:3000) or *")
    return value


def host_name(value: str) -> str:
    """A Host header name to answer: a name or address, *.example.com for its subdomains, or * for any."""
    if not value.isascii() or any(c.isspace() or c in "/@?#" for c in value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a host name (say music.example.com, *.example.com or *)")
    return value


def env_api_keys() -> list[str]:
    """MUSIC3_API_KEY: one or more comma-separated keys (an empty value: none)."""
    value = os.environ.get("MUSIC3_API_KEY", "")
    try:
        return [api_key(key.strip()) for key in value.split(",") if key.strip()]
    except argparse.ArgumentTypeError as exc:
        raise Music3Error(f"MUSIC3_API_KEY: {exc}") from None


class OneLineErrors(argparse.ArgumentParser):
    """An argument error is one line on stderr, exit status 2 (argparse prints the usage before it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="music3serve", description=__doc__)
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="write one song to a .wav or .flac file")
    gen.add_argument("--caption", required=True, type=text_argument("caption", MAX_CAPTION_CHARS),
                     help="music description, or @file (a caption starting with @: put it in a file)")
    gen.add_argument("--lyrics", required=True, type=text_argument("lyrics", MAX_LYRICS_CHARS),
                     help="lyrics with [tags], or @file")
    gen.add_argument("--duration", type=float, default=30.0,
                     help="seconds (default: %(default)s; the model may end sooner)")
    gen.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    gen.add_argument("--steps", type=int, default=contract.DIT_STEPS, help="Euler steps per window (default: %(default)s)")
    gen.add_argument("-o", "--output", required=True, help="output .wav or .flac")
    gen.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    gen.add_argument("--sample-rate", type=int, default=contract.SAMPLE_RATE, choices=OUTPUT_RATES,
                     help="default: %(default)s")
    gen.add_argument("--acoustic-dtype", default="float32", choices=["float32", "bfloat16"],
                     help="stage-1 precision: float32 (the default) is the reference, bfloat16 ~10x faster DiT "
                          "(docs/precision.md)")
    for sub in (gen, serve := commands.add_parser("serve", help="HTTP API: stream songs to clients while they are "
                                                  "written")):
        sub.add_argument("--quantization", default=None, choices=["none", "fp8"],
                         help="both stages: fp8 = e4m3 weights for the talker, FP8 GEMMs for the DiT (bf16 "
                              "activations; docs/precision.md). serve: overrides the deploy config's `quantization`")
    for sub in (gen, serve):
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--model", help="checkpoint folder (diffusers layout)")
        where.add_argument("--tiny", action="store_true",
                           help="tiny random checkpoint (noise-like audio), kept in $XDG_CACHE_HOME (or ~/.cache)/music3serve")
    serve.add_argument("--config", help="deploy YAML (default: the built-in default_deploy.yaml)")
    serve.add_argument("--device", default=None, choices=["cpu", "cuda"],
                       help="run both stages on this device (default: each stage on its deploy-config `devices` GPU, "
                            "split into two processes when they differ; cpu when there is no GPU)")
    serve.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    serve.add_argument("--port", type=port_number, default=8000, help="default: %(default)s")
    serve.add_argument("--ray", action="store_true",
                       help="run as a Ray Serve application (docs/scaling.md) on the Ray cluster at RAY_ADDRESS, "
                            "else on a local Ray started for it")
    scale = serve.add_mutually_exclusive_group()
    scale.add_argument("--replicas", type=at_least(1), help="--ray: engine replicas (default: 1)")
    scale.add_argument("--autoscale", metavar="MIN:MAX", type=argument(replica_range),
                       help="--ray: engine replicas scaled between MIN and MAX by the songs in flight")
    serve.add_argument("--max-queued-songs", type=at_least(0),
                       help="--ray: songs waiting for a replica's slot; past them a POST gets 429 (default: 64)")
    serve.add_argument("--api-key", action="append", type=api_key, default=[],
                       help="every /v1/ request must send Authorization: Bearer KEY (repeat for several keys; "
                            "default: MUSIC3_API_KEY's comma-separated keys, else none: open)")
    serve.add_argument("--allowed-origins", action="extend", type=comma_list(origin), default=[],
                       help="browser origins (https://app.example.com, or *) whose pages may call the API: CORS "
                            "(repeat, or a comma list; default: none)")
    serve.add_argument("--allowed-hosts", action="extend", type=comma_list(host_name), default=[],
                       help="Host header names to answer besides loopback ones on a loopback --host, instead of any "
                            "on other addresses (against DNS rebinding; *.example.com, *; repeat or a comma list)")
    serve.add_argument("--served-model-name", action="append", metavar="NAME",
                       help="a `model` name requests may give (repeat for several; default: "
                            f"{' and '.join(contract.SERVED_MODEL_NAMES)})")

    bench = commands.add_parser("bench", help="GPU benchmarks on full-size models with random weights")
    bench.add_argument("stage", choices=["talker", "acoustic", "precision", "e2e"])
    bench.add_argument("--no-peers", action="store_true",
                       help="talker and acoustic: skip the diffusers reference run (e2e and precision have none)")
    bench.add_argument("--placement", default=None, choices=["colocated", "split", "split-one-gpu"],
                       help="e2e only: where stage 1 runs (default colocated; split needs two GPUs)")
    bench.add_argument("--render-batch", type=positive_int, default=None,
                       help="e2e only: windows per render call (stage 1 max_num_batched_tokens; default: the config's)")
    bench.add_argument("--quantization", default="none", choices=["none", "fp8"],
                       help="talker and acoustic: fp8 adds FP8 rows beside bf16; e2e: both stages in fp8")

    tiny = commands.add_parser("make-tiny", help="write a tiny random checkpoint in the released layout")
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--force", action="store_true", help="replace a checkpoint already in the folder")
    for sub in (gen, serve, bench, tiny):  # also accepted after the subcommand
        sub.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper, choices=LOG_LEVELS)
    return parser


# Argument checks: each command's run only after its check, and no check imports torch or the engine (importing
# them takes seconds), so that a mistake is answered at once. A new flag's check goes into its command's function.
def check_generate(args: argparse.Namespace) -> None:
    check_output(args.output)
    # The pipeline checks these again; here they fail before anything loads.
    frames_for_duration(args.duration)
    check_seed(args.seed)
    check_steps(args.steps)
    check_text("caption", args.caption, MAX_CAPTION_CHARS)
    check_text("lyrics", args.lyrics, MAX_LYRICS_CHARS)
    pdl_mode()


def check_serve(args: argparse.Namespace) -> None:
    ray_only = [f"--{n.replace('_', '-')}" for n in ("replicas", "autoscale", "max_queued_songs")
                if getattr(args, n) is not None]
    if ray_only and not args.ray:
        raise Music3Error(f"{', '.join(ray_only)} apply to `serve --ray` only")
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise Music3Error(f"{SERVE_EXTRA} (missing: {', '.join(missing)}): pip install 'music3serve[serve]'")
    if args.ray and importlib.util.find_spec("ray") is None:
        raise Music3Error("--ray needs Ray Serve (missing: ray): pip install 'music3serve[ray]'")
    args.api_key = args.api_key or env_api_keys()
    args.served_model_name = served_model_names(args.served_model_name)
    args.deploy = load_deploy_config(args.config)
    if args.quantization is not None:
        args.deploy = with_quantization(args.deploy, args.quantization)
    if not (args.ray and os.environ.get("RAY_ADDRESS")):  # else the cluster's proxy listens, not this host
        check_port(args.host, args.port)
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


def run_generate(args: argparse.Namespace) -> None:
    import torch

    from .pipeline import Pipeline
    from .prompt import encode_prompt
    from .tokenizer import load_tokenizer

    check_device(args.device)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    root = resolve_model(args.model, args.tiny)
    if (root / "tokenizer" / "tokenizer.json").is_file():  # the prompt's token limit too, before minutes of loading
        encode_prompt(load_tokenizer(root / "tokenizer"), args.caption, args.lyrics)
    log.info("loading model", extra={"path": str(root), "device": device})
    progress = show_progress()
    pipeline = Pipeline.from_pretrained(root, device=device, acoustic=args.acoustic_dtype, progress=progress,
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
        raise Music3Error(f"{SERVE_EXTRA} ({exc}): pip install 'music3serve[serve]'") from None
    from .serving.access import Access, HostPolicy
    from .serving.engine import Engine

    access = Access(tuple(args.api_key), tuple(args.allowed_origins), HostPolicy.for_bind(args.host, args.allowed_hosts))
    check_device(args.device)
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
        raise Music3Error(f"--ray needs Ray Serve ({exc}): pip install 'music3serve[ray]'") from None
    queue = {} if args.max_queued_songs is None else {"max_queued_songs": args.max_queued_songs}
    app = RayAppArgs(model=args.model, tiny=args.tiny, config=args.config, device=args.device,
                     replicas=args.replicas or 1, autoscale=args.autoscale, api_keys=args.api_key,
                     allowed_origins=args.allowed_origins, allowed_hosts=args.allowed_hosts, host=args.host,
                     served_model_names=list(args.served_model_name), quantization=args.quantization, **queue)
    serve_on_ray(app, args.host, args.port)


def check_device(device: str | None) -> None:
    """`--device cuda` needs a CUDA device torch can see (checked before the weights load)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise Music3Error("--device cuda was asked for, but torch sees no CUDA device")


def show_progress() -> bool:
    """Progress bars on a terminal only (a log file would get every redraw), and not when asked for quiet logs."""
    return sys.stderr.isatty() and logging.getLogger().isEnabledFor(logging.INFO)


def check_port(host: str, port: int) -> None:
    """Fail before the engine loads (minutes for the real checkpoint) if the server could not listen there."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # IPv6 hosts too, as uvicorn binds them
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        raise Music3Error(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


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
