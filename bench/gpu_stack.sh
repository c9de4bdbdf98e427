#!/usr/bin/env bash
# One device call (~8 min, nvidia-h200, carry [".whl", "_stack"]) for branches exported by bench/export_stack.sh:
# the talker step at 1 and 8 songs of each (same process settings, one after another), then the GPU tests of the
# last one (the top of a stack holds every change below it).
source bench/gpu_env.sh
ROOT=$PWD
for dir in "$ROOT"/_stack/*/; do
  name=$(basename "$dir")
  echo "== $name"
  (cd "$dir" && PYTHONPATH=$dir/src:/tmp/site timeout 110 python3 -c 'from music3serve.bench.talker import run; print(run(peers=False, concurrency=(1, 8), depth_modes=(True,)).split("decode attention")[0])' \
    2>&1 | grep "|" | tee "$OUT/talker_$name.txt")
done
top=$(ls -d "$ROOT"/_stack/*/ | tail -1)
echo "== GPU tests of $(basename "$top")"
(cd "$top" && PYTHONPATH=$top/src:/tmp/site timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short \
  -W ignore tests/test_skinny_linear.py tests/test_decode_attention.py tests/test_talker_gpu.py tests/test_pdl.py \
  2>&1 | grep -v DEBUG | tail -12 | tee "$OUT/gpu_tests.txt")
