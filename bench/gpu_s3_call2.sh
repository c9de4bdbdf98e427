#!/usr/bin/env bash
# Session 3, call 2 (~6 min): the skinny GEMM kernel's GPU tests and the talker's GPU tests with it, its sweep
# against cuBLAS on the talker's shapes, and the talker step with it (depth calls cached, the default now).
source bench/gpu_env.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_skinny_linear.py tests/test_talker_gpu.py > "$OUT/gpu_tests.txt" 2>&1
tail -25 "$OUT/gpu_tests.txt"
timeout 200 python3 bench/skinny_linear.py --sweep 2>&1 | grep -v -i warn | tee "$OUT/skinny.txt"
timeout 150 python3 -c "from music3serve.bench.talker import run; print(run(peers=False, depth_modes=(True,)))" 2>&1 | grep -v -i warn | tee "$OUT/talker.txt"
