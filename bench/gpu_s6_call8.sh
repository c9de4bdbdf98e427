#!/usr/bin/env bash
# Session 6, call 8 (~2.5 min, nvidia-h200, carry .whl): the split engine GPU test again after the fix of
# call 7's failure (a worker given "cuda" without an index could not set its device).
source bench/gpu_env.sh
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_engine_gpu.py -k split 2>&1 \
  | tail -4 | tee "$OUT/gpu_tests.txt"
