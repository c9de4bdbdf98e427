"""The command line checks its arguments before it imports torch or the engine: a mistake is answered at once.

Each case runs the CLI in a fresh interpreter, which reports whether torch was imported by the time it exited.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src"
FP8_DEPLOY = Path(__file__).parents[1] / "examples" / "deploy" / "fp8_24gb.yaml"  # both stages quantization: fp8
# Runs cli.main on the arguments and prints, after its output, whether torch (or the engine) was ever imported.
WRAPPER = (
    "import sys\n"
    "from music3serve import cli\n"
    "try:\n"
    "    code = cli.main(sys.argv[1:])\n"
    "except SystemExit as exit_:\n"
    "    code = exit_.code\n"
    "heavy = sorted(m for m in ('torch', 'music3serve.pipeline', 'music3serve.serving.engine') if m in sys.modules)\n"
    "print('imported:', ','.join(heavy) or 'none', file=sys.stderr)\n"
    "sys.exit(code)\n"
)
# Seconds a refusal may take in a fresh interpreter on a busy CI core; importing torch alone takes 4-8 s there.
ANSWER_S = 3.0


def run_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    environ = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True, env=environ,
                          cwd=cwd, timeout=60)
    return done.returncode, done.stderr, time.monotonic() - start


def generate(*extra: str) -> list[str]:
    return ["generate", "--caption", "synth pop", "--lyrics", "[verse]\nla la", "--model", "m", "-o", "song.wav",
            *extra]


CASES = {
    "duration": (generate("--duration", "0"), "duration must be in (0, 360] seconds, got 0.0"),
    "duration-nan": (generate("--duration", "nan"), "duration must be a finite number of seconds"),
    "suffix": (generate("-o", "song.mp3"), "output file must be NAME.wav or NAME.flac"),
    "seed": (generate("--seed", "-1"), "seed must be an integer in [0, 2**64), got -1"),
    "steps": (generate("--steps", "0"), "steps must be an integer in [1, 200], got 0"),
    "sample-rate": (generate("--sample-rate", "8000"), "argument --sample-rate: invalid choice: 8000"),
    "caption-file": (generate("--caption", "@/nonexistent/caption.txt"), "cannot read /nonexistent/caption.txt"),
    "blank-lyrics": (generate("--lyrics", " "), "lyrics must be a non-empty string"),
    "serve-port": (["serve", "--tiny", "--port", "70000"], "70000 is not a TCP port"),
    "serve-config": (["serve", "--tiny", "--config", "/nonexistent/deploy.yaml"], "/nonexistent/deploy.yaml"),
    "serve-model-name": (["serve", "--tiny", "--served-model-name", " "], "--served-model-name must be a name of 1 to"),
    "serve-ray-only": (["serve", "--tiny", "--replicas", "2"], "--replicas applies to `serve --ray` only"),
    "serve-fp8-float32": (["serve", "--tiny", "--quantization", "fp8", "--acoustic-dtype", "float32"],
                          "--quantization fp8 runs stage 1 on bf16 activations"),
    "fp8-float32": (generate("--quantization", "fp8", "--acoustic-dtype", "float32"),
                    "--quantization fp8 runs stage 1 on bf16 activations"),
    # the file's fp8 overrides its own dtype, not the flag's (it was overridden without a word)
    "file-fp8-float32": (["serve", "--tiny", "--config", str(FP8_DEPLOY), "--acoustic-dtype", "float32"],
                         "--acoustic-dtype float32: stage 1 has quantization fp8 in"),
    "empty-model": (generate("--model", ""), "--model is an empty path"),  # it read as no --model at all
    "bench-flags": (["bench", "talker", "--placement", "split"], "apply to `bench e2e` only"),
    "bench-batch": (["bench", "e2e", "--render-batch", "0"], "argument --render-batch: must be at least 1, got 0"),
    "make-tiny-seed": (["make-tiny", "tiny", "--seed", "-1"], "seed must be an integer in [0, 2**64), got -1"),
}


@pytest.mark.parametrize("value", ["abc", "", "0", "-1", "2.5"])
def test_a_bad_omp_num_threads_is_refused_before_torch_is_imported(value, tmp_path: Path):
    """OpenMP ignores a value it cannot read (with a warning of its own) and takes every core: neither refused nor
    replaced by the one thread the docs promise."""
    code, err, _ = run_cli(generate(), tmp_path, env={"OMP_NUM_THREADS": value})
    assert code == 2 and f"OMP_NUM_THREADS={value!r} is not a number of threads" in err, err
    assert err.rstrip().endswith("imported: none"), err


@pytest.mark.parametrize("args, message", list(CASES.values()), ids=list(CASES))
def test_a_bad_argument_is_refused_before_torch_is_imported(args, message, tmp_path: Path):
    code, err, seconds = run_cli(args + ["--log-level", "error"], tmp_path, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert code == 2, err
    assert message in err, err
    assert err.rstrip().endswith("imported: none"), err
    assert seconds < ANSWER_S, f"answered after {seconds:.1f} s"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # --tiny wrote no checkpoint, -o no file


def test_a_bad_pdl_setting_is_refused_before_torch_is_imported(tmp_path: Path):
    code, err, _ = run_cli(generate(), tmp_path, env={"MUSIC3SERVE_PDL": "bogus"})
    assert code == 2 and "MUSIC3SERVE_PDL must be one of all, ours, off, got 'bogus'" in err, err
    assert err.rstrip().endswith("imported: none"), err


def test_good_arguments_go_on_to_import_torch(tmp_path: Path):
    """The wrapper sees an import: a missing model is found only after the checks pass, with torch loaded."""
    env = {"XDG_CACHE_HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "MUSIC3_MODEL": ""}
    args = ["generate", "--caption", "synth pop", "--lyrics", "la", "-o", str(tmp_path / "song.wav")]
    code, err, _ = run_cli(args, tmp_path, env=env)
    assert code == 2 and "no MiniMax-Music3 checkpoint found" in err, err
    assert "imported: music3serve.pipeline,torch" in err, err
