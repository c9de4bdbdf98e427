#!/usr/bin/env bash
# One device call (nvidia-h200, carry .whl; ~4 min): the GPU batch-invariance tests and the kernel tests they rest on,
# then the talker step with the batch-invariant dispatch against the row-count-dependent one, interleaved
# (bench/batch_invariance_ab.py).
source bench/gpu_env.sh
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu -s --tb=short -W ignore tests/test_batch_invariance_gpu.py \
  tests/test_skinny_linear.py tests/test_decode_attention.py tests/test_talker_gpu.py 2>&1 | grep -v DEBUG \
  > "$OUT/gpu_tests.txt"
grep -E "PCM|passed|failed" "$OUT/gpu_tests.txt" | tail -12
timeout 145 python3 bench/batch_invariance_ab.py 2>&1 | grep -v -i warn | tail -30 | tee "$OUT/ab.txt"
