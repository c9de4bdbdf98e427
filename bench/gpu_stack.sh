#!/usr/bin/env bash
# On a GPU machine, for the trees that bench/export_stack.sh exported into _stack/ (wheels in .whl/ installed first).
#   bash bench/gpu_stack.sh steps   the talker step at 1 and 8 songs of each tree, one after another (~1.5 min each)
#   bash bench/gpu_stack.sh dit     the fused bf16 DiT call (graph) at 1 and 8 windows of each tree (~1 min each)
#   bash bench/gpu_stack.sh e2e     each tree's colocated end to end, `music3serve bench e2e` (~2 min each)
#   bash bench/gpu_stack.sh tests [FILE...]   the GPU tests of the last tree (the top of a stack holds every change
#                                   below it; by default the talker's kernel tests), then the skinny GEMM's split-K
#                                   sweep where the tree has one
source bench/gpu_env.sh
ROOT=$PWD
mode=${1:?usage: gpu_stack.sh steps|dit|e2e|tests [FILE...]}
shift
files=${*:-tests/test_skinny_linear.py tests/test_decode_attention.py tests/test_talker_gpu.py tests/test_pdl.py}
top=$(ls -d "$ROOT"/_stack/*/ | tail -1)
if [ "$mode" = steps ]; then
  for dir in "$ROOT"/_stack/*/; do
    name=$(basename "$dir")
    echo "== $name"; start=$SECONDS
    (cd "$dir" && PYTHONPATH=$dir/src:/tmp/site timeout 110 python3 -c 'from music3serve.bench.talker import run; print(run(peers=False, concurrency=(1, 8), depth_modes=(True,)).split("decode attention")[0])' \
      2>&1 | grep "|" | tee "$OUT/talker_$name.txt")
    echo "($((SECONDS - start)) s)"
  done
elif [ "$mode" = dit ]; then
  for dir in "$ROOT"/_stack/*/; do
    name=$(basename "$dir")
    echo "== $name"
    (cd "$dir" && PYTHONPATH=$dir/src:/tmp/site timeout 150 python3 -c 'from music3serve.acoustic.precision import BFLOAT16
from music3serve.bench.acoustic import dit_rows
from music3serve.bench.common import table
print(table(["policy", "windows", "eager ms", "graph ms", "TFLOP/s", "x peak"], dit_rows("cuda", BFLOAT16, (1, 8), fuse=True)))' \
      2>&1 | grep "|" | tee "$OUT/dit_$name.txt")
  done
elif [ "$mode" = e2e ]; then
  for dir in "$ROOT"/_stack/*/; do
    name=$(basename "$dir")
    echo "== $name"
    (cd "$dir" && PYTHONPATH=$dir/src:/tmp/site timeout 150 python3 -m music3serve.cli --log-level WARNING bench e2e \
      --no-peers --placement colocated 2>&1 | grep "|" | tee "$OUT/e2e_$name.txt")
  done
else
  echo "== GPU tests of $(basename "$top")"
  (cd "$top" && PYTHONPATH=$top/src:/tmp/site timeout 250 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short \
    -W ignore $files \
    2>&1 | grep -v DEBUG | tail -12 | tee "$OUT/gpu_tests.txt")
  if grep -q split-sweep "$top/bench/skinny_linear.py"; then
    (cd "$top" && PYTHONPATH=$top/src:/tmp/site timeout 250 python3 bench/skinny_linear.py --split-sweep 2>&1 \
      | grep -v -i warn | tee "$OUT/split_sweep.txt" | tail -40)
  fi
fi
