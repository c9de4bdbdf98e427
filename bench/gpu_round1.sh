#!/usr/bin/env bash
# One device call: GPU tests, then the talker and acoustic benchmarks (full size, random weights).
# Usage on the device machine, from the repo root: bash bench/gpu_round1.sh   (results land in $OUT)
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_talker_gpu.py tests/test_decode_attention.py -m gpu 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
python3 -m music3serve.cli bench talker 2>&1 | grep -v Warning | tee "$OUT/bench_talker.txt"
python3 -m music3serve.cli bench acoustic 2>&1 | grep -v Warning | tee "$OUT/bench_acoustic.txt"
