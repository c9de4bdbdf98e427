#!/usr/bin/env bash
# Ray Serve replicas on one host (music3serve.bench.ray_replicas), call 2 of 2 (carry .whl and .ray_b, on
# nvidia-h200-x2, -x4 or -x8, after bench/ray_stash.sh on the same machine): the plain server and 1, 2 (4, 8) replicas
# of one GPU each, 8 x N concurrent 30 s songs, then the split placement through Ray and `bench e2e --placement split`.
# Arguments go to the benchmark (e.g. --replicas 1,2 --no-split, to fit one call's 10 minutes; later calls on the
# warm machine find Ray installed). Results: $OUT/ray_replicas.json and the printed tables.
source bench/ray_env.sh
timeout 540 python3 -m music3serve.bench.ray_replicas --json "$OUT/ray_replicas.json" "$@" \
  2> "$OUT/ray_replicas.log" | tee "$OUT/ray_replicas.txt"  # Ray's own log lines go to the .log
if [[ " $* " != *" --no-split "* ]] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 240 python3 -m music3serve.cli bench e2e --placement split 2>&1 | tail -12 | tee "$OUT/e2e_split.txt"
fi
