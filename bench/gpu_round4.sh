#!/usr/bin/env bash
# One device call (2026-11-30, session 2): every GPU test (failures in full), the acoustic bench (DiT per
# policy, plain and fused; vocoder per precision), the precision variants, the colocated engine end to end.
source bench/gpu_env.sh
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests > "$OUT/gpu_tests.txt" 2>&1
grep -E "passed|failed|Error|assert" "$OUT/gpu_tests.txt" | tail -25
timeout 150 python3 -m music3serve.cli --log-level WARNING bench acoustic --no-peers 2>&1 | grep -v -i warn | tee "$OUT/bench_acoustic.txt"
timeout 90 python3 -m music3serve.cli --log-level WARNING bench precision 2>&1 | tail -4 | tee "$OUT/precision.txt"
timeout 170 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers 2>&1 | grep -v -i warn | tail -8 | tee "$OUT/e2e.txt"
