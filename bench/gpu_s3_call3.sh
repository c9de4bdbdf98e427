#!/usr/bin/env bash
# Session 3, call 3 (~7 min): every GPU test; the skinny kernels with the measured tiles, the gated SwiGLU half and
# the residual epilogue; the talker step with them (depth calls cached) and its kernel table.
source bench/gpu_env.sh
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests > "$OUT/gpu_tests.txt" 2>&1
tail -25 "$OUT/gpu_tests.txt"
timeout 60 python3 bench/skinny_linear.py 2>&1 | grep -v -i warn | tee "$OUT/skinny.txt"
timeout 150 python3 -c "from music3serve.bench.talker import run; print(run(peers=False, depth_modes=(True,)))" 2>&1 | grep -v -i warn | tee "$OUT/talker.txt"
timeout 100 python3 bench/profile_gpu.py talker 2>&1 | grep -v -i warn | tee "$OUT/profile.txt"
