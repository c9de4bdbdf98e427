#!/usr/bin/env bash
# Session 22, call 1 (nvidia-h200, carry .whl, ~6 min): the eight- and one-window DiT calls sustained for 6 s each
# beside a plain matmul, with the card's clock and power (issue #4's 70% target), then the talker step and the
# colocated end to end (bench/gpu_s18_measure.sh), on main.
source bench/gpu_env.sh
timeout 150 python3 bench/dit_clocks.py 2>&1 | grep -v Warning | tee "$OUT/dit_clocks.txt"
bash bench/gpu_s18_measure.sh
