#!/usr/bin/env bash
# Session 19, call 1 (nvidia-h200, carry .whl and _stack, ~8 min): main's bf16 bit-for-bit test of the one-gather
# depth input table, then the talker step of the trees exported by
# `bash bench/export_stack.sh 0main=main 1qk=wip/qk-rope-attention 2draw=wip/depth-draw 3main=main`.
source bench/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_talker_gpu.py -k looked_up \
  2>&1 | grep -v DEBUG | tail -8 | tee "$OUT/main_table_test.txt"
bash bench/gpu_stack.sh steps
