#!/usr/bin/env bash
# Session 5, call 5 (~6 min, nvidia-h200, carry .whl): the PDL chain test (fixed: the chain now stays finite) and
# the engine end to end, colocated, with everything of this session (add-norm kernel, PDL for the talker's kernels).
source bench/gpu_env.sh
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_skinny_linear.py \
  -k "pdl or graph_replay" 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
timeout 290 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers --placement colocated 2>&1 \
  | grep -v -i warn | tee "$OUT/e2e_colocated.txt" | tail -8
