#!/usr/bin/env bash
# For the next GPU session, call 2 (~5 min, nvidia-h200-x2, carry .whl): the engine end to end with session 4's
# talker (pipelined loop, KV store in the attention kernel, top-k kernel), colocated and split over two GPUs.
source bench/gpu_env.sh
for placement in colocated split; do
  timeout 150 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers --placement $placement 2>&1 | grep -v -i warn | tee "$OUT/e2e_$placement.txt" | tail -6
done
