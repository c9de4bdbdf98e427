#!/usr/bin/env bash
# Every GPU benchmark behind docs/performance.md and every GPU test, on a CUDA machine, from the repository root:
#
#   bash bench/gpu_all.sh [PART...]     PART: tests talker acoustic precision e2e ready split clocks (default: all)
#
# Each part writes $OUT/<part>.md (OUT defaults to ./bench-out): the command, date, commit and GPU, then the part's
# tables in the layout of docs/performance.md. $OUT/performance.md joins every part present, so parts can run in
# separate runs (the whole run takes about 30 minutes: tests ~8, talker ~4, acoustic ~4, precision ~3, e2e ~3,
# ready ~4, clocks ~1). `split` needs two GPUs and is skipped on one.
#
# PYTHON (default python3) runs everything. Needs torch with CUDA and music3serve's test extra (diffusers for the
# reference rows of `talker` and `acoustic`), plus the hopper extra on H100/H200. On a machine without network
# access, wheels in .whl/ are installed first (bench/gpu_env.sh) and the hopper extra from .cute_b/
# (bench/hopper_env.sh); bench/README.md says how.
set -u
OUT=${OUT:-$PWD/bench-out}
if [ -d .cute_b ]; then
  source bench/hopper_env.sh  # sources bench/gpu_env.sh first
elif [ -d .whl ]; then
  source bench/gpu_env.sh
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
CLI="$PYTHON -m music3serve.cli --log-level WARNING"

# run PART SECONDS COMMAND...: the command's output (warnings dropped) under a header, into $OUT/PART.md.
run() {
  local part=$1 limit=$2
  shift 2
  echo "== $part: $*"
  {
    echo "## $part"
    echo
    echo "\`$*\` ($(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)," \
      "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(nvidia-smi -L | wc -l) GPU)"
    echo
    timeout "$limit" "$@" 2>&1 | grep -v -i -e warning -e "^ *warnings\.warn"
    echo
  } > "$OUT/$part.md"
  tail -n 25 "$OUT/$part.md"
}

part_tests() { run tests 900 $PYTHON -m pytest -q -rfs -p no:cacheprovider -m gpu --tb=short -W ignore tests; }
part_talker() { run talker 600 $CLI bench talker; }
part_acoustic() { run acoustic 600 $CLI bench acoustic; }
part_precision() { run precision 600 $CLI bench precision; }
part_e2e() { run e2e 600 $CLI bench e2e --placement colocated; }
part_ready() { run ready 600 $CLI bench ready; }
part_clocks() { run clocks 300 $PYTHON bench/dit_clocks.py; }
part_split() {
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    run split 600 $CLI bench e2e --placement split
  else
    echo "== split: skipped (one GPU)"
  fi
}

parts=${*:-tests talker acoustic precision e2e ready split clocks}
for part in $parts; do
  case $part in
    tests|talker|acoustic|precision|e2e|ready|split|clocks) "part_$part" ;;
    *) echo "unknown part '$part' (tests talker acoustic precision e2e ready split clocks)" >&2; exit 2 ;;
  esac
done
{
  echo "# GPU results ($(date -u +%Y-%m-%d))"
  echo
  for part in tests talker acoustic precision e2e ready split clocks; do
    [ -f "$OUT/$part.md" ] && cat "$OUT/$part.md"
  done
} > "$OUT/performance.md"
echo "wrote $OUT/performance.md"
