#!/usr/bin/env bash
# Session 3, call 1 (written in session 2 as gpu_next.sh, ~7 min): what session 2 changed but could not measure.
# GPU tests (talker graphs with cached depth calls, split_rope, renderer), the talker in both depth modes, the
# acoustic bench with the policy as it is now (IEEE islands, TF32 vocoder convolutions), the engine end to end.
source bench/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests > "$OUT/gpu_tests.txt" 2>&1
grep -E "passed|failed|Error|assert" "$OUT/gpu_tests.txt" | tail -12
timeout 170 python3 -m music3serve.cli --log-level WARNING bench talker --no-peers 2>&1 | grep -v -i warn | tee "$OUT/bench_talker.txt"
timeout 100 python3 -m music3serve.cli --log-level WARNING bench acoustic --no-peers 2>&1 | grep -v -i warn | tee "$OUT/bench_acoustic.txt"
timeout 130 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers 2>&1 | grep -v -i warn | tail -6 | tee "$OUT/e2e.txt"
