#!/usr/bin/env bash
# Branch wip/dit-add-norm, one call (~5 min, nvidia-h200, carry .whl): the DiT's residual add + layer norm as one
# Triton kernel per row (kernels/add_layer_norm.py). Its GPU tests and the DiT's other GPU tests, then the fused DiT
# call (bf16 policy, graph) with the kernel and, in the same process, with main's torch ops (inductor's looped
# reductions). Merge into main if the tests pass and the kernel is faster (main, session 4: 13.25 ms one window,
# 104.37 ms eight).
source bench/gpu_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_add_layer_norm.py \
  tests/test_renderer.py tests/test_bf16x3.py tests/test_split_rope.py 2>&1 | tail -15
AB='
from unittest import mock
import torch
from music3serve.acoustic.precision import BFLOAT16
from music3serve.bench.acoustic import dit_rows
from music3serve.bench.common import table
from music3serve.models import dit
with mock.patch.object(dit, "uses_add_norm_kernel", lambda *a: False):  # main: the torch ops, fused by inductor
    rows = [["torch ops (main)", *r[1:]] for r in dit_rows("cuda", BFLOAT16, (1, 8), fuse=True)]
torch._dynamo.reset()
rows += [["add_layer_norm kernel", *r[1:]] for r in dit_rows("cuda", BFLOAT16, (1, 8), fuse=True)]
print(table(["add + norm", "windows", "eager ms", "graph ms", "TFLOP/s", "x peak"], rows))
'
timeout 200 python3 -c "$AB" 2>&1 | grep -v -i warn | tee "$OUT/dit_add_norm.txt"
