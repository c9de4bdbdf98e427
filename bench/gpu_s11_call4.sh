#!/usr/bin/env bash
# Session 11, call 4 (carry .whl and _stack from `bash bench/export_stack.sh 0fuse=wip/glue-fusion`): the GPU tests
# of the talker and the engines on the branch, then its colocated end to end.
set -u
bash bench/gpu_stack.sh tests tests/test_talker_gpu.py tests/test_engine_gpu.py tests/test_pdl.py
bash bench/gpu_stack.sh e2e
