#!/usr/bin/env bash
# Session 6, call 7 (~6 min, nvidia-h200, carry .whl): the engine GPU tests with the split placement on one GPU
# (the new outbox and heartbeat), then where the talker's step goes now (kernel table, PDL off so kernels do not
# count their waits; the timeout of session 6 call 2's profile was too short for a cold compile).
source bench/gpu_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_engine_gpu.py 2>&1 \
  | tail -4 | tee "$OUT/gpu_tests.txt"
MUSIC3SERVE_PDL=off timeout 180 python3 bench/profile_gpu.py talker 2>&1 | grep -v -i warn > "$OUT/profile_talker.txt"
grep -A14 "###" "$OUT/profile_talker.txt"
