#!/usr/bin/env bash
# Session 17, call 2 (nvidia-h200, carry .whl and _stack from `bash bench/export_stack.sh 0main=main
# 1attn=wip/dit-attention 2main=main 3attn=wip/dit-attention`, ~8 min): the attention tile sweep again around the
# chosen tile, the fused bf16 DiT call of each tree, and the renderer's and the kernel's GPU tests on the branch.
source bench/gpu_env.sh
(cd _stack/1attn && PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 bench/dit_attention.py 2>&1 | grep -v -i warn \
  | tail -30 | tee "$OUT/attention.txt")
bash bench/gpu_stack.sh dit
bash bench/gpu_stack.sh tests tests/test_dit_attention.py tests/test_renderer.py
