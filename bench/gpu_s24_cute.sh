#!/usr/bin/env bash
# Session 24, calls 2-4 (nvidia-h200, carry .whl and .cute_b, after bench/gpu_s24_stash.sh; ~3 min): the GPU tests
# named in "$@", then bench/dit_glu.py (quack's fused gate and flash-attn-4 against ours).
source bench/gpu_cute_env.sh
[ $# -gt 0 ] && timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu "$@" 2>&1 | tail -15
timeout 420 python3 bench/dit_glu.py 2>&1 | grep -v -i warning | tee "$OUT/dit_glu.txt"
