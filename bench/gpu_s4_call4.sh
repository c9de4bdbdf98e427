#!/usr/bin/env bash
# Session 4, call 4 (nvidia-h200, carry .whl): every GPU test, then the talker step (pipelined engine loop, KV
# append inside decode attention, top-k threshold kernel, gated depth tile), its kernel table, and one colocated
# end-to-end run.
source bench/gpu_env.sh
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests > "$OUT/gpu_tests.txt" 2>&1
tail -25 "$OUT/gpu_tests.txt"
TALKER='from music3serve.bench.talker import run; print(run(peers=False, concurrency=(1, 2, 4, 8), depth_modes=(True,)))'
timeout 100 python3 -c "$TALKER" 2>&1 | grep -v -i warn | tee "$OUT/talker.txt"
timeout 60 python3 bench/profile_gpu.py talker 2>&1 | grep -v -i warn > "$OUT/profile_talker.txt"
grep -A12 "###" "$OUT/profile_talker.txt"
timeout 120 python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers --placement colocated 2>&1 | grep -v -i warn | tee "$OUT/e2e_colocated.txt" | tail -8
