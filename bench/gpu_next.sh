#!/usr/bin/env bash
# For the next GPU session, call 1 (~5 min, nvidia-h200, carry .whl; give the machine back right after): every GPU
# test on main after session 6's serving changes (outbox, heartbeat and watch of the split worker; the split engine
# test on one GPU) and its merges (semantic top-k, depth decode attention, fused vocoder).
source bench/gpu_env.sh
timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests 2>&1 | tail -12 \
  | tee "$OUT/gpu_tests.txt"
