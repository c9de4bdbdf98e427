#!/usr/bin/env bash
# Session 16, last call (nvidia-h200, carry .whl): every GPU test on main, full output kept (~8 min on a cold machine).
source bench/gpu_env.sh
timeout 570 python3 -m pytest -q -rfs -p no:cacheprovider -m gpu --tb=short -W ignore --show-capture=no tests \
  > "$OUT/full.txt" 2>&1
tail -25 "$OUT/full.txt"
