"""bench/encoders.py runs on the CPU (`--tiny`) as it will on the GPU box: both its tables come out whole."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("av")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]


def test_the_encoder_bench_runs_on_the_cpu():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from encoders import ENDPOINTS, FORMATS
    finally:
        sys.path.remove(str(ROOT / "bench"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "bench/encoders.py"), "--tiny", "--windows", "1", "--seconds",
                          "0.2"], capture_output=True, text=True, env=env, timeout=600, check=True).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    shares = {(cells[0].strip(), cells[1].strip()): cells[2:] for cells in rows if "%" in cells[-1]}
    costs = {(cells[0].strip(), cells[1].strip()) for cells in rows if cells[0].strip() in FORMATS
             and "%" not in cells[-1]}
    assert costs == {(fmt, rate) for fmt in FORMATS for rate in ("44100", "32000")}
    # what encoding adds to time to first audio: ms to first bytes and their share of speech PCM's, at each concurrency
    assert set(shares) == {("wav", "32000"), ("flac", "32000"), ("mp3", "32000"), ("opus", "48000"), ("aac", "32000")}
    assert all(re.fullmatch(r" \d+\.\d ms = \d+\.\d\d% ", cell) for cells in shares.values() for cell in cells)
    assert all(len(cells) == 2 for cells in shares.values())
    timings = {cells[0].strip(): [float(c) for c in cells[1:]] for cells in rows if cells[0].strip() in ENDPOINTS}
    assert set(timings) == set(ENDPOINTS) and all(len(t) == 4 and min(t) > 0 for t in timings.values())
