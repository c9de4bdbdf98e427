#!/usr/bin/env bash
# For the next GPU session, call 2 of 3 (~9 min, nvidia-h200, carry .whl): the full acoustic bench (bf16x3 against
# IEEE islands), the full-size precision of both (docs/precision.md lists it as still to be measured), and the
# DiT kernel tables at one and eight windows.
source bench/gpu_env.sh
timeout 200 python3 -m music3serve.cli --log-level WARNING bench acoustic --no-peers 2>&1 | grep -v -i warn | tee "$OUT/bench_acoustic.txt"
timeout 200 python3 -m music3serve.cli --log-level WARNING bench precision 2>&1 | grep -v -i warn | tee "$OUT/precision.txt"
timeout 150 python3 bench/profile_gpu.py dit 2>&1 | grep -v -i warn | tee "$OUT/profile_dit.txt"
