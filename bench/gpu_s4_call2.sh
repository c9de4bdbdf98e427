#!/usr/bin/env bash
# Session 4, call 2 (nvidia-h200, carry .whl): colocated contention (bench/contention.py: talker and DiT alone and
# side by side, cuBLAS SM carveout, green contexts) and the DiT kernel tables at one and eight windows.
source bench/gpu_env.sh
timeout 240 python3 bench/contention.py 2>&1 | grep -v -i warn | tee "$OUT/contention.txt"
timeout 200 python3 bench/profile_gpu.py dit 2>&1 | grep -v -i warn > "$OUT/profile_dit.txt"
head -50 "$OUT/profile_dit.txt"
