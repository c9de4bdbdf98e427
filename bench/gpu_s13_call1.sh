#!/usr/bin/env bash
# Session 13, call 1 (carry .whl and _stack from `bash bench/export_stack.sh 0base=703e0a0 1main=main`, ~6 min,
# nvidia-h200): the talker step with and without the head logits' float copies (aec6f0b), a kernel table of main's
# talker step, and main's colocated end to end. Call 2 was `bash bench/gpu_next.sh`.
set -u
bash bench/gpu_stack.sh steps
(cd _stack/1main && PROFILE_TALKER_ROWS=90 PYTHONPATH=$PWD/src:/tmp/site timeout 120 python3 bench/profile_gpu.py talker \
  > "$OUT/profile_talker.txt" 2>&1; tail -5 "$OUT/profile_talker.txt")
(cd _stack/1main && PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 -m music3serve.cli --log-level WARNING bench e2e \
  --no-peers --placement colocated 2>&1 | grep "|" | tee "$OUT/e2e_main.txt")
