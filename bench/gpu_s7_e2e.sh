#!/usr/bin/env bash
# Session 7, call 6 (~5 min, nvidia-h200-x2, carry .whl): main (talker as in session 6) end to end, colocated and
# split, with the split worker's window slots (call 4 ran them beside a slower experimental talker).
source bench/gpu_env.sh
E2E="python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers"
timeout 140 $E2E --placement colocated 2>&1 | grep -v -i warn | tee "$OUT/e2e_colocated.txt" | tail -6
timeout 130 $E2E --placement split 2>&1 | grep -v -i warn | tee "$OUT/e2e_split.txt" | tail -6
