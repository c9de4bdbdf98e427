#!/usr/bin/env bash
# Session 23, call 2 (nvidia-h200, carry .whl, ~4 min): the DiT call with torch's TunableOp choosing each GEMM's
# cuBLASLt algorithm against cuBLAS's defaults, A/B in one process (branch wip/tunableop).
source bench/gpu_env.sh
timeout 400 python3 bench/dit_tunable.py "$OUT/tunableop_results.csv" 2>&1 | grep -v Warning | tail -60 \
  | tee "$OUT/tunable.txt"
