#!/usr/bin/env bash
# Session 16, call 1 (nvidia-h200, carry .whl): the loader's NaN/inf check on full-size components and a 16 GB load,
# then the GPU tests that close engines on CUDA (talker and engine).
source bench/gpu_env.sh
timeout 240 python3 bench/load_check.py /tmp/lm_ckpt 2>&1 | tee "$OUT/load_check.txt"
rm -rf /tmp/lm_ckpt
timeout 300 python3 -m pytest -q -rfs -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_engine_gpu.py \
  tests/test_talker_gpu.py 2>&1 | tail -20 | tee "$OUT/gpu_tests.txt"
