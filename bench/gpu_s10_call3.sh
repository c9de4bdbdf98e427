#!/usr/bin/env bash
# Session 10, call 3 (nvidia-h200, carry .whl; no two-GPU machine was lent): main end to end with one worker
# (colocated) and two workers on the one GPU (split-one-gpu), then the fused bf16 DiT call at one window and four
# times at eight windows in one process.
source bench/gpu_env.sh
E2E="python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers"
timeout 140 $E2E --placement colocated 2>&1 | grep -v -i warn | tee "$OUT/e2e_colocated.txt" | tail -6
timeout 160 $E2E --placement split-one-gpu 2>&1 | grep -v -i warn | tee "$OUT/e2e_split_one_gpu.txt" | tail -6
timeout 150 python3 -c 'from music3serve.acoustic.precision import BFLOAT16
from music3serve.bench.acoustic import dit_rows
from music3serve.bench.common import table
print(table(["policy", "windows", "eager ms", "graph ms", "TFLOP/s", "x peak"], dit_rows("cuda", BFLOAT16, (1, 8, 8, 8, 8), fuse=True)))' \
  2>&1 | grep "|" | tee "$OUT/dit_repeats.txt"
