#!/usr/bin/env bash
# Session 20, last call (nvidia-h200, carry .whl, ~8.5 min): every GPU test on main after the session's refactors
# (the depth decoder's compiled block, the Euler step shared by the graphed loop), then the talker step (one and
# eight songs) to show the refactors cost nothing.
source bench/gpu_env.sh
timeout 420 python3 -m pytest -q -rfs -p no:cacheprovider -m gpu --tb=short -W ignore --show-capture=no tests \
  > "$OUT/full.txt" 2>&1
tail -8 "$OUT/full.txt"
timeout 120 python3 -c "from music3serve.bench.talker import run; print(run(peers=False, concurrency=(1, 8), depth_modes=(True,)))" \
  2>&1 | grep -v Warning | head -8 | tee "$OUT/talker.txt"
