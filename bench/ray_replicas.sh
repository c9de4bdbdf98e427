#!/usr/bin/env bash
# Ray Serve replicas on one host of 2-8 GPUs (music3serve.bench.ray_replicas): the plain server and 1, 2 (4, 8)
# replicas of one GPU each, 8 x N concurrent 30 s songs, then the split placement through Ray and
# `bench e2e --placement split`. Arguments go to the benchmark (e.g. --replicas 1,2 --no-split, for a shorter run).
# Results: $OUT/ray_replicas.json and the printed tables. Needs the `ray` extra; on a GPU machine without network
# access, bench/ray_stash.sh first (bench/README.md).
if python3 -c "import ray.serve" 2>/dev/null; then source bench/gpu_env.sh; else source bench/ray_env.sh; fi
timeout 540 python3 -m music3serve.bench.ray_replicas --json "$OUT/ray_replicas.json" "$@" \
  2> "$OUT/ray_replicas.log" | tee "$OUT/ray_replicas.txt"  # Ray's own log lines go to the .log
if [[ " $* " != *" --no-split "* ]] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 240 python3 -m music3serve.cli bench e2e --placement split 2>&1 | tail -12 | tee "$OUT/e2e_split.txt"
fi
