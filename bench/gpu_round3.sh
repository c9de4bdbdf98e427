#!/usr/bin/env bash
# One device call: the engine end to end on full-size random weights (bf16 acoustic stage).
source bench/gpu_env.sh
timeout 420 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers 2>&1 | grep -v -i warn | tee "$OUT/e2e.txt"
