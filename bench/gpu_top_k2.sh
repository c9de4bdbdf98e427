#!/usr/bin/env bash
# Branch wip/semantic-top-k, one call (~4 min, nvidia-h200, carry .whl): the semantic draws' threshold (16385
# columns) in two passes of the bitonic top-k kernel instead of torch.topk (~70 us a call, 2 per step, session 5
# kernel table). Its GPU tests, the per-call bench, then the talker step at one and eight songs. Merge into main if
# the tests pass and the step is faster (main, session 5 call 4 with PDL all: 7.30 ms one song, 8.15 ms eight).
source bench/gpu_env.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_top_k.py tests/test_sampling.py 2>&1 | tail -5
timeout 60 python3 bench/top_k.py 2>&1 | grep -v -i warn | tee "$OUT/top_k.txt"
timeout 150 python3 -c 'from music3serve.bench.talker import run; print(run(peers=False, concurrency=(1, 8), depth_modes=(True,)).split("decode attention")[0])' 2>&1 | grep "|" | tee "$OUT/talker.txt"
