#!/usr/bin/env bash
# Session 17, call 1 (nvidia-h200, carry .whl, ~4 min): the DiT attention kernel's GPU tests, then its tile sweep
# against SDPA (bench/dit_attention.py).
source bench/gpu_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_dit_attention.py 2>&1 \
  | grep -v DEBUG | tail -30 | tee "$OUT/tests.txt"
timeout 300 python3 bench/dit_attention.py 2>&1 | grep -v -i warn | tail -40 | tee "$OUT/attention.txt"
