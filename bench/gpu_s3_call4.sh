#!/usr/bin/env bash
# Session 3, last call (~6 min): the skinny GPU tests (gated bound fixed); the talker (1 and 8 songs); the DiT call with bf16x3
# islands against IEEE islands (fused, 1 and 8 windows); the engine end to end (colocated).
source bench/gpu_env.sh
timeout 45 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=line -W ignore tests/test_skinny_linear.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -6
timeout 70 python3 -c "from music3serve.bench.talker import run; print(run(peers=False, depth_modes=(True,), concurrency=(1, 8)))" 2>&1 | grep -v -i warn | head -8 | tee "$OUT/talker.txt"
timeout 90 python3 -c "
from music3serve.bench.acoustic import dit_rows, IEEE_ISLANDS, PEAK_TFLOPS
from music3serve.acoustic.precision import BFLOAT16
from music3serve.bench.common import table
rows = dit_rows('cuda', BFLOAT16, [1, 8], fuse=True) + dit_rows('cuda', IEEE_ISLANDS, [1, 8], fuse=True)
print(table(['policy', 'windows', 'eager ms', 'graph ms', 'TFLOP/s', 'x peak'], rows))
" 2>&1 | grep -v -i warn | tee "$OUT/dit.txt"
timeout 150 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers 2>&1 | grep -v -i warn | tee "$OUT/e2e.txt" | tail -6
