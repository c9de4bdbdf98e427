#!/usr/bin/env bash
# Every GPU test on main (~4 min, nvidia-h200, carry .whl; give the machine back right after), with the reasons of
# the skipped ones.
source bench/gpu_env.sh
timeout 540 python3 -m pytest -q -rs -p no:cacheprovider -m gpu --tb=short -W ignore tests 2>&1 | tail -16 \
  | tee "$OUT/gpu_tests.txt"
