#!/usr/bin/env bash
# For the next GPU session, call 2 of 2 (~9 min, nvidia-h200-x2, carry .whl): the acoustic bench, and the engine end
# to end colocated and split over two GPUs with the session 3 code (skinny talker, bf16x3 islands).
source bench/gpu_env.sh
timeout 200 python3 -m music3serve.cli --log-level WARNING bench acoustic --no-peers 2>&1 | grep -v -i warn | tee "$OUT/bench_acoustic.txt"
for placement in colocated split; do
  timeout 150 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers --placement $placement 2>&1 | grep -v -i warn | tee "$OUT/e2e_$placement.txt" | tail -6
done
