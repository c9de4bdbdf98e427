#!/usr/bin/env bash
# First of two runs that install the `hopper` extra on a GPU machine without network access, where each copy of the
# tree to it holds at most 64 MiB (see bench/README.md): leaves the first part of nvidia-cutlass-dsl-libs-cu13's 92 MB
# wheel (copied along in .cute_a/) in /tmp/cute on the machine; the next run on the same machine sources
# bench/hopper_env.sh with the rest copied along in .cute_b/.
set -u
mkdir -p /tmp/cute && cp .cute_a/* /tmp/cute/ && ls -la /tmp/cute
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
python3 -c "import sys, torch; print(sys.version, torch.__version__, torch.version.cuda)"
