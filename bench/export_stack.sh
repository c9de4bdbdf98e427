#!/usr/bin/env bash
# Export branches' src/, tests/ and bench/ into _stack/<name>/ (git-ignored) so one device call measures them side by
# side: `bash bench/export_stack.sh 0main=main 1splitk=wip/skinny-split-k ...`, then run bench/gpu_stack.sh with
# carry [".whl", "_stack"]. Names sort in the order to measure; the last one's GPU tests run too.
set -eu
rm -rf _stack
for spec in "$@"; do
  name=${spec%%=*} branch=${spec#*=}
  mkdir -p "_stack/$name"
  git archive "$branch" src tests bench | tar -x -C "_stack/$name"
done
ls _stack
