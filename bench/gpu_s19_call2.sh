#!/usr/bin/env bash
# Session 19, call 2 (nvidia-h200, carry .whl and _stack, ~6 min): the rotation branch compiled without fp contraction
# (exported to _stack/1qk from a worktree): its GPU kernel and precision tests, then its talker step against main's.
source bench/gpu_env.sh
(cd _stack/1qk && PYTHONPATH=$PWD/src:/tmp/site timeout 240 python3 -m pytest -q -rfs -p no:cacheprovider -m gpu --tb=short \
  -W ignore --show-capture=no tests/test_decode_attention.py tests/test_talker_precision_gpu.py 2>&1 | grep -v DEBUG \
  | tail -15 | tee "$OUT/qk_tests.txt")
bash bench/gpu_stack.sh steps
