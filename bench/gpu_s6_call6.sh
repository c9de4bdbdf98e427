#!/usr/bin/env bash
# Session 6, call 6 (~6 min, nvidia-h200, carry .whl): the vocoder's Snake activations fused (one pass each instead
# of six eager kernels): its GPU test, `bench/vocoder.py` (eager / fused / fused + cuDNN autotuner, per window, with
# SNRs), then the engine end to end colocated.
source bench/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_renderer.py \
  tests/test_fusion.py 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
timeout 150 python3 bench/vocoder.py 2>&1 | grep -v -i warn | tee "$OUT/vocoder.txt" | tail -6
timeout 240 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers --placement colocated 2>&1 \
  | grep -v -i warn | tee "$OUT/e2e_colocated.txt" | tail -6
