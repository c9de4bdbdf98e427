#!/usr/bin/env bash
# For the next GPU session, call 1 (~6 min, nvidia-h200, carry .whl; give the machine back right after): every
# GPU test, and the talker bench with all four concurrency levels (session 4 measured 1 and 8 songs after its
# last change; 2 and 4 only before it).
source bench/gpu_env.sh
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests > "$OUT/gpu_tests.txt" 2>&1
tail -15 "$OUT/gpu_tests.txt"
timeout 150 python3 -m music3serve.cli --log-level WARNING bench talker --no-peers 2>&1 | grep -v -i warn | tee "$OUT/talker.txt"
timeout 60 python3 bench/profile_gpu.py talker 2>&1 | grep -v -i warn > "$OUT/profile_talker.txt"; grep -A14 "###" "$OUT/profile_talker.txt"
