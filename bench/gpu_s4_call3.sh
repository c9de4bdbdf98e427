#!/usr/bin/env bash
# Session 4, call 3 (nvidia-h200, carry .whl): contention with green contexts that stay alive (call 2's were
# collected: "context is destroyed"), DiT SM shares down to half; inductor max-autotune for the fused DiT.
source bench/gpu_env.sh
timeout 200 python3 bench/contention.py 2>&1 | grep -v -i warn | tee "$OUT/contention.txt"
timeout 300 python3 bench/dit_autotune.py 2>&1 | grep -v -i -E "warn|autotune_select|^  [a-z_]+ [0-9.]+ ms" | tail -40 | tee "$OUT/dit_autotune.txt"
