#!/usr/bin/env bash
# Export branches' src/, tests/ and bench/ into _stack/<name>/ (git-ignored) so one run on a GPU machine measures them
# side by side: `bash bench/export_stack.sh 0main=main 1new=my-branch ...`, then run bench/gpu_stack.sh there (with
# _stack/ and, without network access, .whl/ copied along). Names sort in the order to measure; the last one's GPU
# tests run too.
set -eu
rm -rf _stack
for spec in "$@"; do
  name=${spec%%=*} branch=${spec#*=}
  mkdir -p "_stack/$name"
  git archive "$branch" src tests bench | tar -x -C "_stack/$name"
done
ls _stack
