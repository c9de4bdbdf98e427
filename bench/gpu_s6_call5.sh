#!/usr/bin/env bash
# Session 6, call 5 (~7 min, nvidia-h200-x2, carry .whl): main with the semantic top-k kernel and the depth
# decoder's decode attention merged: the talker step at 1, 2, 4 and 8 songs (depth calls cached), then the engine
# end to end colocated (one GPU) and split (stage 1 on the second GPU).
source bench/gpu_env.sh
timeout 200 python3 -c 'from music3serve.bench.talker import run; print(run(peers=False, depth_modes=(True,)))' \
  2>&1 | grep "|" | tee "$OUT/talker.txt"
E2E="python3 -m music3serve.cli --log-level WARNING bench e2e --no-peers"
timeout 200 $E2E --placement colocated 2>&1 | grep -v -i warn | tee "$OUT/e2e_colocated.txt" | tail -6
timeout 170 $E2E --placement split 2>&1 | grep -v -i warn | tee "$OUT/e2e_split.txt" | tail -6
