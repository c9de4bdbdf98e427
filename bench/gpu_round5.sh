#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (2026-11-30, session 2): the GPU tests fixed after round 4, then the engine
# end to end colocated, split over two GPUs, and split into two workers on one GPU.
source bench/gpu_env.sh
timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_renderer.py \
  tests/test_split_rope.py tests/test_talker_gpu.py > "$OUT/gpu_tests.txt" 2>&1
grep -E "passed|failed|Error|assert" "$OUT/gpu_tests.txt" | tail -12
for placement in colocated split split-one-gpu; do
  timeout 150 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers --placement $placement 2>&1 \
    | grep -v -i warn | tail -7 | tee "$OUT/e2e_$placement.txt"
done
