#!/usr/bin/env bash
# Session 24, call 6 (nvidia-h200, carry .whl and .cute_b, after bench/gpu_s24_stash.sh; ~6 min): the fused gate's
# whole-call A/B and precision (bench/dit_glu.py), then `music3serve bench acoustic` and the colocated end to end
# with the `hopper` extra installed.
source bench/gpu_cute_env.sh
timeout 240 python3 bench/dit_glu.py 2>&1 | grep -v -i warning | tee "$OUT/dit_glu.txt"
timeout 200 python3 -m music3serve.cli --log-level WARNING bench acoustic --no-peers 2>&1 | grep -v -i warning \
  | tail -25 | tee "$OUT/acoustic.txt"
timeout 150 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers --placement colocated 2>&1 \
  | grep -v -i warning | tail -20 | tee "$OUT/e2e.txt"
