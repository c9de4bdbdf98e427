#!/usr/bin/env bash
# Session 24, call 1 (nvidia-h200, carry .cute_a): the first 58 MB of nvidia-cutlass-dsl-libs-cu13's 92 MB wheel
# stashed on the machine (one call carries at most 64 MiB); call 2 (bench/gpu_s24_cute.sh) carries the rest.
set -u
mkdir -p /tmp/cute && cp .cute_a/* /tmp/cute/ && ls -la /tmp/cute
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
python3 -c "import sys, torch; print(sys.version, torch.__version__, torch.version.cuda)"
python3 -m pip list 2>/dev/null | grep -i -E "cuda|cutlass|tvm|einops|protobuf|typing"
which ptxas nvcc
