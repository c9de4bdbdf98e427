#!/usr/bin/env bash
# For the next GPU session, call 2 (~7 min, nvidia-h200-x2, carry .whl): the engine end to end with session 4's
# talker, colocated and split over two GPUs; and colocated with one window per render call. Batching windows
# buys the DiT almost nothing (13.25 ms for one window, 104.4 ms for eight), but it makes the eight songs of the
# concurrent scenario wait for all eight first windows (first audio 5.7 s for every song): does a render batch of
# one give most songs their first audio much earlier at the same total time?
source bench/gpu_env.sh
E2E="python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers"
timeout 140 $E2E --placement colocated 2>&1 | grep -v -i warn | tee "$OUT/e2e_colocated.txt" | tail -6
timeout 140 $E2E --placement colocated --render-batch 1 2>&1 | grep -v -i warn | tee "$OUT/e2e_colocated_batch1.txt" | tail -6
timeout 140 $E2E --placement split 2>&1 | grep -v -i warn | tee "$OUT/e2e_split.txt" | tail -6
