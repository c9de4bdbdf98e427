#!/usr/bin/env bash
# One device call: the engine end to end on full-size random weights (bf16 acoustic stage).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
timeout 420 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers 2>&1 | grep -v -i warn | tee "$OUT/e2e.txt"
