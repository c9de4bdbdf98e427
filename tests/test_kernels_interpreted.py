"""The Triton kernels on the CPU: tests/kernels_interpreted/ under Triton's interpreter, in a child pytest.

A child process, because the interpreter must be on before the kernels are built and a process that imported Triton
keeps it: the rest of the suite runs without Triton (and torch.compile's CPU path with it). `make install-test` puts
Triton in .venv/triton-interpret, outside the environment; MUSIC3SERVE_TRITON_SITE names another folder, and a Triton
importable here serves too."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDER = Path(__file__).with_name("kernels_interpreted")


def triton_site() -> str | None:
    """The folder to put on the child's path for Triton ("" when it imports here already), or None: no Triton."""
    site = Path(os.environ.get("MUSIC3SERVE_TRITON_SITE") or ROOT / ".venv" / "triton-interpret")
    if (site / "triton" / "__init__.py").is_file():
        return str(site)
    return "" if importlib.util.find_spec("triton") is not None else None


def test_the_triton_kernels_under_the_interpreter():
    site = triton_site()
    if site is None:
        why = "the interpreted kernel tests need Triton: make install-test puts it in .venv/triton-interpret"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    path = [site, str(ROOT / "src"), env.get("PYTHONPATH", "")]
    env.update(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in path if p))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(FOLDER)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, f"{run.stdout[-8000:]}\n{run.stderr[-4000:]}"
    if " passed" not in summary:
        pytest.skip(f"no interpreted kernel test ran: {summary}")
