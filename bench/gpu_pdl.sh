#!/usr/bin/env bash
# Session 5, call 4 (~6 min, nvidia-h200, carry .whl): programmatic dependent launch (kernels/pdl.py). The GPU tests
# of the kernels and the talker (all now run with PDL, the default), then the talker step and the DiT call with
# MUSIC3SERVE_PDL=off / ours / all, each mode in its own process (inductor's generated code differs per mode).
source bench/gpu_env.sh
python3 -c "import torch._inductor.config as c; print('inductor enable_pdl available:', hasattr(c.triton, 'enable_pdl'))"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore tests/test_skinny_linear.py \
  tests/test_decode_attention.py tests/test_talker_gpu.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.txt"
TALKER='from music3serve.bench.talker import run; print(run(peers=False, concurrency=(1, 8), depth_modes=(True,)).split("decode attention")[0])'
DIT='
from music3serve.acoustic.precision import BFLOAT16
from music3serve.bench.acoustic import dit_rows
for r in dit_rows("cuda", BFLOAT16, (1, 8), fuse=True): print("DiT windows", r[1], "graph ms", round(r[3], 2), "x peak", round(r[5], 3))
'
for mode in off ours all; do
  echo "## MUSIC3SERVE_PDL=$mode" | tee -a "$OUT/pdl.txt"
  MUSIC3SERVE_PDL=$mode timeout 150 python3 -c "$TALKER" 2>&1 | grep -v -i warn | grep "|" | tee -a "$OUT/pdl.txt"
  [ "$mode" = ours ] || MUSIC3SERVE_PDL=$mode timeout 90 python3 -c "$DIT" 2>&1 | grep "^DiT" | tee -a "$OUT/pdl.txt"
done
MUSIC3SERVE_PDL=all timeout 60 python3 bench/profile_gpu.py talker 2>&1 | grep -v -i warn > "$OUT/profile_talker.txt"
grep -A8 "###" "$OUT/profile_talker.txt"
