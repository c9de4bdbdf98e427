#!/usr/bin/env bash
# One device call: every GPU test, then bench/profile_gpu.py (where the talker, DiT and vocoder time goes).
source bench/gpu_env.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
timeout 320 python3 bench/profile_gpu.py "$@" 2>&1 | grep -v -i warn | tee "$OUT/profile.txt"
