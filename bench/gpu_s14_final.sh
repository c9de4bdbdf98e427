#!/usr/bin/env bash
# Session 14's last device call (~7 min, nvidia-h200, carry .whl): the talker precision test with the depth
# projections as the engine runs them, and the GPU tests of the code changed since session 13's full GPU run
# (the engine's watched admission, stage 1's warm-up window, the stricter checkpoint loader).
source bench/gpu_env.sh
timeout 500 python3 -m pytest -q -s -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_talker_precision_gpu.py \
  tests/test_engine_gpu.py tests/test_renderer.py 2>&1 | grep -E "^\| |passed|failed|Error|FAILED" | tee "$OUT/gpu_tests.txt"
