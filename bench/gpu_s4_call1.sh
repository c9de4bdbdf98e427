#!/usr/bin/env bash
# Session 4, call 1 (nvidia-h200, carry .whl and .normfold = a copy of branch wip/norm-fold's src/ and tests/; the
# branch was deleted after this call measured it slower, docs/performance.md session 4):
# main's talker step as the baseline on this machine; the branch's GPU tests, talker step and kernel table; the
# skinny tile sweep including the gated kernel.
source bench/gpu_env.sh
TALKER='from music3serve.bench.talker import run; print(run(peers=False, concurrency=(1, 8), depth_modes=(True,)))'
timeout 90 python3 -c "$TALKER" 2>&1 | grep -v -i warn | tee "$OUT/talker_main.txt"
BRANCH="PYTHONPATH=$PWD/.normfold/src:/tmp/site"
env $BRANCH timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore \
  .normfold/tests/test_skinny_linear.py .normfold/tests/test_talker_gpu.py > "$OUT/gpu_tests_branch.txt" 2>&1
tail -15 "$OUT/gpu_tests_branch.txt"
env $BRANCH timeout 90 python3 -c "$TALKER" 2>&1 | grep -v -i warn | tee "$OUT/talker_branch.txt"
env $BRANCH timeout 60 python3 bench/profile_gpu.py talker 2>&1 | grep -v -i warn > "$OUT/profile_talker_branch.txt"
timeout 150 python3 bench/skinny_linear.py --sweep 2>&1 | grep -v -i warn | tee "$OUT/skinny.txt" | tail -30
