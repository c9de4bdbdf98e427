#!/usr/bin/env bash
# For the next GPU session, call 3 of 3 (~9 min, nvidia-h200-x2, carry .whl): the engine end to end, colocated and
# split over two GPUs, with the session 3 code; then bench/contention.py: does keeping SMs away from the DiT
# (cuBLAS carveout, green contexts) speed up the colocated talker (a 20 s song: 5.8 s, its talker alone ~4.5 s)?
source bench/gpu_env.sh
for placement in colocated split; do
  timeout 150 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers --placement $placement 2>&1 | grep -v -i warn | tee "$OUT/e2e_$placement.txt" | tail -6
done
timeout 220 python3 bench/contention.py 2>&1 | grep -v -i warn | tee "$OUT/contention.txt"
