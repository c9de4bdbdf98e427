#!/usr/bin/env bash
# For the next GPU session, call 1 (~5 min, nvidia-h200, carry .whl; give the machine back right after): the GPU
# tests of this session's last changes (PDL producers that let a kernel start 100 us before its input is written,
# the kernels' launch keyword, fusion options), then which SDPA backend runs the DiT's attention fastest
# (bench/dit_sdpa.py: eight windows are at 69.3% of peak, 70% is the target; the attention is ~9 ms of ~102).
source bench/gpu_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_skinny_linear.py \
  tests/test_decode_attention.py tests/test_fusion.py tests/test_top_k.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.txt"
timeout 240 python3 bench/dit_sdpa.py 2>&1 | grep -v -i warn | tee "$OUT/dit_sdpa.txt" | tail -12
