#!/usr/bin/env bash
# For the next GPU session, call 3 (~6 min, nvidia-h200-x2, carry .whl): the engine end to end with one worker
# against two workers on one GPU (issue 5 asks for both; last measured in session 2), and the split placement
# with this session's talker (PDL).
source bench/gpu_env.sh
E2E="python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers"
timeout 280 $E2E --placement split-one-gpu 2>&1 | grep -v -i warn | tee "$OUT/e2e_split_one_gpu.txt" | tail -6
timeout 280 $E2E --placement split 2>&1 | grep -v -i warn | tee "$OUT/e2e_split.txt" | tail -6
