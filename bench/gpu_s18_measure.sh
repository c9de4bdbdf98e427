#!/usr/bin/env bash
# Session 18, call 3 (nvidia-h200, carry .whl, ~5 min): the talker step (one and eight songs, as the engine runs it,
# with the depth decoder's lookup table) and the colocated end to end, on main.
source bench/gpu_env.sh
timeout 200 python3 -c "from music3serve.bench.talker import run; print(run(peers=False, concurrency=(1, 8), depth_modes=(True,)))" \
  2>&1 | grep -v Warning | tee "$OUT/talker.txt"
timeout 240 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers --placement colocated 2>&1 \
  | grep -v Warning | tail -20 | tee "$OUT/e2e.txt"
