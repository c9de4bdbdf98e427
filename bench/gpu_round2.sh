#!/usr/bin/env bash
# One device call: GPU tests, fused talker step, bf16-vs-float32 precision at full size, the engine end to end.
source bench/gpu_env.sh
timeout 130 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_talker_gpu.py tests/test_decode_attention.py tests/test_renderer.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
timeout 180 python3 -m music3serve.cli --log-level WARNING bench talker --no-peers 2>&1 | grep -v Warning | tee "$OUT/bench_talker.txt"
timeout 60 python3 -m music3serve.cli --log-level WARNING bench precision 2>&1 | tail -3 | tee "$OUT/precision.txt"
timeout 200 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers 2>&1 | grep -v Warning | tail -12 | tee "$OUT/e2e.txt"
