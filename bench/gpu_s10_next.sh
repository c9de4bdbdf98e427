#!/usr/bin/env bash
# Prepared in session 9 for the next GPU session (nvidia-h200-x2, carry .whl; two calls):
#   bash bench/gpu_s10_next.sh sweep   the skinny GEMM's tile sweep with the 16 KB L2 prefetch (the session 3 sweep
#                                      ran with 64 KB), to update MEASURED_TILES in kernels/skinny_linear.py
#   bash bench/gpu_s10_next.sh e2e     end to end colocated and split, and the DiT repeats (bench/gpu_s9_e2e.sh)
source bench/gpu_env.sh
case ${1:?usage: gpu_s10_next.sh sweep|e2e} in
  sweep) timeout 560 python3 bench/skinny_linear.py --sweep 2>&1 | grep -v -i warn | tee "$OUT/sweep.txt" | tail -40 ;;
  e2e) bash bench/gpu_s9_e2e.sh ;;
esac
