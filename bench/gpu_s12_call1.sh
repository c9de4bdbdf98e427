#!/usr/bin/env bash
# Prepared in session 12 (no device time was left to run it): carry .whl and _stack from `bash bench/export_stack.sh
# 0base=703e0a0 1float=main`. The talker step with and without the head logits' float copies (aec6f0b), main's full
# kernel list of the step, then the GPU tests of the talker and the engines (the stage watch threads on CUDA).
set -u
bash bench/gpu_stack.sh steps
PROFILE_TALKER_ROWS=90 timeout 200 python3 bench/profile_gpu.py talker 2>&1 | grep -v -i warn | tee "$OUT/profile_talker.txt" | head -110
bash bench/gpu_stack.sh tests tests/test_talker_gpu.py tests/test_engine_gpu.py tests/test_pdl.py
