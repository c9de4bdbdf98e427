#!/usr/bin/env bash
# For the next GPU session, one call: every GPU test (multi-song engine included), the talker bench and the
# engine end to end (dumps thread stacks if a scenario stalls). Results in $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
timeout 150 python3 -m music3serve.cli --log-level WARNING bench talker --no-peers 2>&1 | grep -v Warning | tee "$OUT/bench_talker.txt"
timeout 240 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers 2>&1 | grep -v -i warn | tee "$OUT/e2e.txt"
