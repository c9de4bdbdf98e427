#!/usr/bin/env bash
# Session 4, call 5 (nvidia-h200, carry .whl; the last ~6 minutes of device time): the top-k kernel's GPU tests
# and warp sweep (now only for the depth decoder's 1024 columns), the talker step again, and the full-size
# precision of bf16x3 islands against IEEE islands (docs/precision.md).
source bench/gpu_env.sh
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_top_k.py 2>&1 | tail -5
timeout 40 python3 bench/top_k.py 2>&1 | grep -v -i warn | tee "$OUT/top_k.txt"
TALKER='from music3serve.bench.talker import run; print(run(peers=False, concurrency=(1, 8), depth_modes=(True,)))'
timeout 90 python3 -c "$TALKER" 2>&1 | grep -v -i warn | head -8 | tee "$OUT/talker.txt"
PRECISION='
import torch
from types import SimpleNamespace
from music3serve.acoustic.precision import BFLOAT16
from music3serve.bench.precision import compare_policies
from music3serve.bench.acoustic import IEEE_ISLANDS
from music3serve.bench.common import random_module
def models():
    names = ("condition_encoder", "dit", "vocoder")
    return SimpleNamespace(**{n: random_module(n, "cuda", torch.float32, seed=i) for i, n in enumerate(names)})
for row in compare_policies(models(), models, [BFLOAT16, IEEE_ISLANDS], frames=450):
    print(row)
'
timeout 150 python3 -c "$PRECISION" 2>&1 | grep -v -i warn | tee "$OUT/precision.txt"
