#!/usr/bin/env bash
# Session 24, last call (nvidia-h200, carry .whl and .cute_b, after bench/gpu_s24_stash.sh): every GPU test with the
# `hopper` extra installed, full output kept (~8 min).
source bench/gpu_cute_env.sh
timeout 560 python3 -m pytest -q -rfs -p no:cacheprovider -m gpu --tb=short -W ignore --show-capture=no tests \
  > "$OUT/full.txt" 2>&1
tail -25 "$OUT/full.txt"
