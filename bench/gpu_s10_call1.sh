#!/usr/bin/env bash
# Session 10, call 1 (nvidia-h200, carry .whl): the skinny GEMM's tiles re-swept at 2 rows with the 16 KB L2
# prefetch (the session 3 sweep ran with 64 KB), then the DiT feed-forward in row chunks (bench/dit_ff_chunks.py).
source bench/gpu_env.sh
timeout 420 python3 bench/skinny_linear.py --sweep --rows 2 2>&1 | grep -v -i warn | tee "$OUT/sweep.txt" | tail -30
timeout 150 python3 bench/dit_ff_chunks.py 2>&1 | grep -v -i warn | tee "$OUT/ff_chunks.txt" | tail -20
