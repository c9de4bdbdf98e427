#!/usr/bin/env bash
# Session 17, call 3 (nvidia-h200, carry .whl, ~3 min): the DiT call with our attention kernel against SDPA,
# interleaved in one process (bench/dit_attention_ab.py), twice.
source bench/gpu_env.sh
for run in 1 2; do
  timeout 200 python3 bench/dit_attention_ab.py 2>&1 | grep -v -i warn | tail -6 | tee "$OUT/ab_$run.txt"
done
