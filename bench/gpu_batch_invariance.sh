#!/usr/bin/env bash
# The GPU batch-invariance checks, one device call each (nvidia-h200, carry .whl); whole logs under $OUT:
#   bash bench/gpu_batch_invariance.sh probe   (<= 5 min) bench/batch_invariance_probe.py, then the talker's GPU
#                                              invariance tests (tests/test_batch_invariance_gpu.py without the renders)
#   bash bench/gpu_batch_invariance.sh verify  (<= 5 min) every GPU invariance test, then the kernel and talker GPU tests
#   bash bench/gpu_batch_invariance.sh history (<= 4 min) bench/batch_invariance_history.py: scenarios in one order
#                                              and another, solo runs between them, each order in a process of its own
#   bash bench/gpu_batch_invariance.sh ab      (<= 5 min) bench/batch_invariance_ab.py: the talker step against the
#                                              row-count-dependent dispatch it replaced, interleaved
source bench/gpu_env.sh
tests() {  # timeout, log name, pytest arguments...
  local limit=$1 log=$2
  shift 2
  timeout "$limit" python3 -m pytest -v -p no:cacheprovider -m gpu -rf --tb=line -W ignore "$@" > "$OUT/$log" 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed|error|\.py:[0-9]+: " "$OUT/$log" | grep -v DEBUG | cut -c1-300 | tail -40
}
case "${1:-probe}" in
  probe)
    timeout 150 python3 bench/batch_invariance_probe.py > "$OUT/probe.txt" 2>&1
    grep "Recompiling function" "$OUT/probe.txt" | cut -c1-250 | head -8
    grep -v -i -E "warn|Recompiling|^\s*$" "$OUT/probe.txt" | cut -c1-400 | tail -75
    tests 135 invariance_tests.txt -k "not windows" tests/test_batch_invariance_gpu.py ;;
  verify)
    tests 170 invariance_tests.txt tests/test_batch_invariance_gpu.py
    tests 120 kernel_tests.txt tests/test_skinny_linear.py tests/test_decode_attention.py tests/test_talker_gpu.py ;;
  history)
    for order in "solo,in pair 1,beside idle graph rows,solo,moved to pair 0,solo" "solo,moved to pair 0,beside 7,solo"; do
      echo "--- $order"
      timeout 110 python3 bench/batch_invariance_history.py "$order" 2> "$OUT/history_stderr.txt"
      grep -E "^===|Recompiling function" "$OUT/history_stderr.txt" | cut -c1-200
    done ;;
  ab)
    timeout 290 python3 bench/batch_invariance_ab.py > "$OUT/ab.txt" 2>&1
    grep -E "^\|" "$OUT/ab.txt" | cut -c1-160 | tail -100 ;;
esac
