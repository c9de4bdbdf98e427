#!/usr/bin/env bash
# For the next GPU session, call 1 of 3 (~8 min, nvidia-h200, carry .whl; give the machine back right after):
# every GPU test, and the skinny kernels' tile sweep, now including the gated kernel (its depth-decoder tile
# streams worse than the plain one: pick a tile of its own).
source bench/gpu_env.sh
timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests > "$OUT/gpu_tests.txt" 2>&1
tail -15 "$OUT/gpu_tests.txt"
timeout 160 python3 bench/skinny_linear.py --sweep 2>&1 | grep -v -i warn | tee "$OUT/skinny.txt" | tail -30
