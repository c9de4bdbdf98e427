#!/usr/bin/env bash
# One device call: every GPU test, then bench/profile_gpu.py (where the talker, DiT and vocoder time goes).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
timeout 320 python3 bench/profile_gpu.py "$@" 2>&1 | grep -v -i warn | tee "$OUT/profile.txt"
