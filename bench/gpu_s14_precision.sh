#!/usr/bin/env bash
# The talker's bf16 precision against the float32 reference and the reference's own bf16 run (tiny and wide checkpoints,
# tests/test_talker_precision_gpu.py; ~2.5 min, nvidia-h200, carry .whl): the measured rows go to docs/precision.md.
source bench/gpu_env.sh
timeout 300 python3 -m pytest -q -s -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_talker_precision_gpu.py \
  2>&1 | grep -E "^\| |passed|failed|Error" | tee "$OUT/talker_precision.txt"
