#!/usr/bin/env bash
# Next session's first call (nvidia-h200, carry .whl, ~7-9 min; most important first): the GPU tests written after
# session 19's device time was spent, the standing numbers on main (talker one and eight songs, colocated end to end),
# then bench/dit_clocks.py (is the eight-window DiT call clock-bound?). Every GPU test: `bash bench/gpu_s16_final.sh`,
# a call of its own.
source bench/gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_decode_attention.py \
  tests/test_talker_gpu.py -k "rotation or decode_rows" 2>&1 | grep -v DEBUG | tail -12 | tee "$OUT/new_tests.txt"
bash bench/gpu_s18_measure.sh
timeout 120 python3 bench/dit_clocks.py 2>&1 | grep -v -i warn | tee "$OUT/dit_clocks.txt" | tail -30
