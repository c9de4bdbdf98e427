#!/usr/bin/env bash
# Session 16, call 3 (nvidia-h200, carry .whl, ~8 min): the talker step (one and eight songs, cached depth keys, as
# the engine runs it) and the colocated end to end, to re-check the standing numbers on main.
source bench/gpu_env.sh
timeout 260 python3 -c "from music3serve.bench.talker import run; print(run(peers=False, concurrency=(1, 8), depth_modes=(True,)))" \
  2>&1 | grep -v Warning | tee "$OUT/talker.txt"
timeout 300 python3 -m music3serve.cli bench e2e 2>&1 | grep -v Warning | tail -20 | tee "$OUT/e2e.txt"
