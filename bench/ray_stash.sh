#!/usr/bin/env bash
# Ray Serve on a GPU machine without network access, where each copy of the tree to it holds at most 64 MiB (see
# bench/README.md): Ray's 79 MB cp312 wheel goes in two copies. This script, run with .ray_a copied along, leaves the
# wheel's first 60 MB on the machine; then bench/ray_replicas.sh, run on the same machine with .ray_b and .whl copied
# along, installs the whole (bench/ray_env.sh).
#
# Before the first copy, on a machine with network access (keep both folders out of git):
#   python3 -m pip download --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d /tmp/raywheels \
#     'ray[serve]>=2.60,<3' fastapi==0.163.2 uvicorn==0.54.0 h11==0.16.0 httpx==0.28.1
#   mkdir -p .ray_a .ray_b && split -b 60000000 /tmp/raywheels/ray-2.60.0-cp312-*.whl ray_whl.part_
#   mv ray_whl.part_aa .ray_a/ && mv ray_whl.part_ab .ray_b/
#   cp /tmp/raywheels/*.whl .ray_b/ && rm .ray_b/ray-2.60.0-* .ray_b/numpy-* .ray_b/pyyaml-* .ray_b/virtualenv-* \
#     .ray_b/py_spy-*          # the machine has numpy and PyYAML; Serve needs neither virtualenv nor py-spy
set -u
mkdir -p /tmp/raywheels && cp .ray_a/* /tmp/raywheels/ && ls -la /tmp/raywheels
nvidia-smi --query-gpu=index,name,memory.total --format=csv
python3 -c "import sys, torch; print(sys.version, torch.__version__, torch.cuda.device_count(), 'GPUs')"
