#!/usr/bin/env bash
# Prepared in session 12 (no device time was left to run it): carry .whl and _stack from `bash bench/export_stack.sh
# 0base=703e0a0 1main=main` (~8 min, nvidia-h200). The talker step with and without the head logits' float copies
# (aec6f0b), then every GPU test on main (the stage watch and the stage-1 split into serving/stage1.py run on CUDA
# there), then main's colocated end to end.
set -u
bash bench/gpu_stack.sh steps
bash bench/gpu_next.sh
(cd _stack/1main && PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 -m music3serve.cli --log-level WARNING bench e2e \
  --no-peers --placement colocated 2>&1 | grep "|" | tee "$OUT/e2e_main.txt")
