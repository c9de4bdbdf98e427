#!/usr/bin/env bash
# Ray Serve on the GPU machine, call 1 of 2 (carry .ray_a): Ray's 79 MB cp312 wheel is over one call's 64 MiB carry,
# so its first 60 MB are left on the machine here; call 2 (bench/ray_replicas.sh, within the machine's idle time)
# carries the rest in .ray_b with the other wheels and installs them (bench/ray_env.sh).
#
# Before call 1, here (both folders listed in .git/info/exclude):
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
