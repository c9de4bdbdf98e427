"""The command line's parser: its commands, options and help."""

from __future__ import annotations

import argparse
from typing import NoReturn

from . import contract
from .cli_access import api_key, host_name, origin
from .cli_args import argument, at_least, comma_list, port_number, positive_int, replica_range, text_argument
from .prompt import MAX_CAPTION_CHARS, MAX_LYRICS_CHARS
from .serving.audio_io import OUTPUT_RATES

DESCRIPTION = """Command line: `music3serve generate ...`, `music3serve serve ...`, `music3serve bench ...` and
`music3serve make-tiny DIR`."""

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class OneLineErrors(argparse.ArgumentParser):
    """An argument error is one line on stderr, exit status 2 (argparse prints the usage before it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="music3serve", description=DESCRIPTION)
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
    gen.add_argument("-o", "--output", required=True, help="output .wav or .flac (missing folders are made)")
    gen.add_argument("--device", default=None, choices=["cpu", "cuda"],
                     help="default: cuda when available (the CPU runs one thread unless OMP_NUM_THREADS says more)")
    gen.add_argument("--sample-rate", type=int, default=contract.SAMPLE_RATE, choices=OUTPUT_RATES,
                     help="default: %(default)s")
    for sub in (gen, serve := commands.add_parser("serve", help="HTTP API: stream songs to clients while they are "
                                                  "written")):
        is_gen = sub is gen
        sub.add_argument("--acoustic-dtype", default=None, choices=["float32", "bfloat16"],
                         help="stage-1 precision: float32 is the reference, bfloat16 makes DiT calls 13x faster "
                              "(docs/precision.md); default: "
                              + ("float32" if is_gen else "the deploy config's stage 1 `dtype` (float32 built in)"))
        sub.add_argument("--quantization", default=None, choices=["none", "fp8"],
                         help="both stages: fp8 = e4m3 weights for the talker, FP8 GEMMs for the DiT (bf16 "
                              "activations; docs/precision.md); default: "
                              + ("none" if is_gen else "the deploy config's `quantization`"))
    for sub in (gen, serve):
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--model", help="checkpoint folder (diffusers layout)")
        where.add_argument("--tiny", action="store_true",
                           help="tiny random checkpoint (noise-like audio), kept in $XDG_CACHE_HOME (or ~/.cache)/music3serve")
    serve.add_argument("--config", help="deploy YAML (default: the built-in default_deploy.yaml)")
    serve.add_argument("--device", default=None, choices=["cpu", "cuda"],
                       help="run both stages on this device (default: each stage on its deploy-config `devices` GPU, "
                            "split into two processes when they differ; cpu when there is no GPU, on one thread "
                            "unless OMP_NUM_THREADS says more)")
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
    bench.add_argument("stage", choices=["talker", "acoustic", "precision", "e2e", "ready"],
                       help="talker: the frame step; acoustic: the DiT call and vocoder; precision: bf16 (and FP8) "
                            "error against float32; e2e: whole songs through the engine; ready: seconds to a ready "
                            "engine per stage-1 precision, each in a fresh process")
    bench.add_argument("--no-peers", action="store_true",
                       help="talker and acoustic: skip the diffusers reference run (e2e and precision have none)")
    bench.add_argument("--placement", default=None, choices=["colocated", "split", "split-one-gpu"],
                       help="e2e only: where stage 1 runs (default colocated; split needs two GPUs)")
    bench.add_argument("--render-batch", type=positive_int, default=None,
                       help="e2e only: windows per render call (stage 1 max_num_batched_tokens; default: the config's)")
    bench.add_argument("--quantization", default="none", choices=["none", "fp8"],
                       help="talker and acoustic: fp8 adds FP8 rows beside bf16; e2e: both stages in fp8")

    tiny = commands.add_parser("make-tiny", help="write a tiny random checkpoint in the released layout")
    tiny.add_argument("directory", help="folder to write it into (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of its random weights (default: %(default)s)")
    tiny.add_argument("--force", action="store_true", help="replace a checkpoint already in the folder")
    for sub in (gen, serve, bench, tiny):  # also accepted after the subcommand
        sub.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper, choices=LOG_LEVELS)
    return parser
