#!/usr/bin/env bash
# Session 11, call 5 (carry .whl and _stack from `bash bench/export_stack.sh 0main=main 1qk=wip/qk-joint
# 2pad=wip/depth-pad`): the talker step of each tree, then the talker's GPU tests on the top one.
set -u
bash bench/gpu_stack.sh steps
bash bench/gpu_stack.sh tests tests/test_talker_gpu.py
