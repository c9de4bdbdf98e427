#!/usr/bin/env bash
# Session 11, call 3 (carry .whl and _stack from `bash bench/export_stack.sh 0main=main 1fuse=wip/glue-fusion
# 2main=main 3fuse=wip/glue-fusion`): the talker step of the first two trees, the DiT call of all four.
set -u
mkdir -p _stack_steps && mv _stack/2main _stack/3fuse _stack_steps/
bash bench/gpu_stack.sh steps
mv _stack_steps/* _stack/
bash bench/gpu_stack.sh dit
