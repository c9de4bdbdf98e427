#!/usr/bin/env bash
# FP8 (quantization: fp8) on one H200-class GPU, in under 10 minutes: the FP8 kernels' GPU tests, then bf16 and FP8
# side by side on full-size random weights, most important first (each step has its own timeout, all of them one
# deadline, DEADLINE seconds; results in $OUT; a step given 0 s is skipped, e.g. DIT_S=0): the talker step, whole
# songs, memory under a 22 GB cap and precision first, then the DiT call and the kernels' bandwidth.
source bench/gpu_env.sh
DEADLINE=${DEADLINE:-575}
step() {  # step NAME SECONDS COMMAND...: run it (within the deadline), keep its output, show its tail
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS)) t0=$SECONDS
  [ "$left" -lt 20 ] || [ "$limit" -eq 0 ] && { echo "== $name skipped"; return; }
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "== $name rc=$? $((SECONDS - t0)) s"; tail -n 16 "$OUT/$name.txt"
}
step tests 150 python3 -m pytest -q -rfs -p no:cacheprovider -m gpu -s tests/test_fp8_gpu.py
step talker ${TALKER_S:-150} python3 -c "from music3serve.bench import talker
print(talker.run(concurrency=(1, 8), peers=False, quantization='fp8', depth_modes=(True,)))"
step e2e_fp8 130 python3 -c "from music3serve.bench import e2e
e2e.SCENARIOS = [('one 20 s song', [20.0]), ('eight 30 s songs', [30.0] * 8)]
print(e2e.run(quantization='fp8'))"
step e2e_bf16 100 python3 -c "from music3serve.bench import e2e
e2e.SCENARIOS = [('one 20 s song', [20.0])]
print(e2e.run())"
step memory 90 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m music3serve.bench.fp8 memory
step precision 120 python3 -m music3serve.bench.fp8 precision --frames 150
step dit ${DIT_S:-0} python3 -c "from music3serve.bench import acoustic as a
from music3serve.acoustic.precision import BFLOAT16, FP8
rows = a.dit_rows('cuda', BFLOAT16, (1, 8), fuse=True) + a.dit_rows('cuda', FP8, (1, 8), fuse=True)
print(a.table(['policy', 'windows', 'eager ms', 'graph ms', 'TFLOP/s', 'x bf16 peak'], rows)); print(a.gemm_rates())"
step kernel ${KERNEL_S:-0} python3 -m music3serve.bench.fp8 kernel
