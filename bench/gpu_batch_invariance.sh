#!/usr/bin/env bash
# One device call (nvidia-h200, carry .whl; ~7 min): the GPU batch-invariance tests, then the kernel tests they rest
# on, then the talker step with the batch-invariant dispatch against the row-count-dependent one, interleaved
# (bench/batch_invariance_ab.py). Each part keeps its whole log under $OUT.
source bench/gpu_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -s -rf --tb=short -W ignore \
  tests/test_batch_invariance_gpu.py 2>&1 | grep -v DEBUG > "$OUT/invariance_tests.txt"
grep -E "PCM|passed|failed|FAILED|differ" "$OUT/invariance_tests.txt" | tail -20
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short -W ignore tests/test_skinny_linear.py \
  tests/test_decode_attention.py tests/test_talker_gpu.py 2>&1 | grep -v DEBUG > "$OUT/kernel_tests.txt"
grep -E "passed|failed|FAILED" "$OUT/kernel_tests.txt" | tail -12
timeout 120 python3 bench/batch_invariance_ab.py 2>&1 | grep -v -i warn | tail -30 | tee "$OUT/ab.txt"
