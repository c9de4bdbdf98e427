#!/usr/bin/env bash
# Session 8, last call (~5 min, nvidia-h200, carry .whl): main with the in-place DiT RoPE: the acoustic table
# (`music3serve bench acoustic --no-peers`) and the colocated end-to-end run.
source bench/gpu_env.sh
CLI="python3 -m music3serve.cli --log-level WARNING bench"
timeout 230 $CLI acoustic --no-peers 2>&1 | grep -v -i warn | tee "$OUT/acoustic.txt" | tail -24
timeout 150 $CLI e2e --no-peers --placement colocated 2>&1 | grep -v -i warn | tee "$OUT/e2e_colocated.txt" | tail -6
