#!/usr/bin/env bash
# Session 13, calls 3 and 4 (carry .whl and _stack, ~6 min each, nvidia-h200). Call 3: `bash bench/export_stack.sh
# 0main=main 1l2=wip/l2-projection 2fold=wip/position-fold`; call 4 the fold alone after a fix (`2fold=...`). The
# talker step of each tree, then the top tree's GPU tests of the skinny GEMM, the talker graphs, PDL and the engine.
set -u
bash bench/gpu_stack.sh steps
bash bench/gpu_stack.sh tests tests/test_skinny_linear.py tests/test_talker_gpu.py tests/test_pdl.py tests/test_engine_gpu.py
