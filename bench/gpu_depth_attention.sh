#!/usr/bin/env bash
# Branch wip/depth-decode-attention, one call (~5 min, nvidia-h200, carry .whl): the cached depth calls on the
# decode attention kernel (keys and values in buffers, stored by the kernel) instead of cuDNN SDPA over two
# concatenations (24 SDPA + 48 cat kernels per step: 0.21 ms at one song, 0.51 ms at eight, session 5 call 1);
# with one split (any capacity of at most 64 positions) the split kernel writes the result and no combine runs.
# Merge into main if the tests pass and the step is faster (main, session 5 call 4, PDL all: 7.30 / 8.15 ms).
source bench/gpu_env.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_talker_gpu.py \
  tests/test_decode_attention.py 2>&1 | tail -6
timeout 150 python3 -c 'from music3serve.bench.talker import run; print(run(peers=False, concurrency=(1, 8), depth_modes=(False, True)).split("decode attention")[0])' 2>&1 | grep "|" | tee "$OUT/talker.txt"
MUSIC3SERVE_PDL=off timeout 60 python3 bench/profile_gpu.py talker 2>&1 | grep -v -i warn > "$OUT/profile_talker.txt"; grep -A12 "###" "$OUT/profile_talker.txt"
