# Sourced by the scripts that run Ray Serve on a GPU machine without network access: bench/gpu_env.sh, then Ray and
# its Serve dependencies installed once per machine into /tmp/ray_site, from the wheel's first part that
# bench/ray_stash.sh left in /tmp/raywheels and the rest copied along in .ray_b (how both are made: bench/ray_stash.sh).
source bench/gpu_env.sh
SITE=/tmp/ray_site
WHEEL=/tmp/raywheels/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
install_split_wheel $SITE ray $WHEEL /tmp/raywheels/ray_whl.part_aa .ray_b/ray_whl.part_ab \
  b951b40965947a63615830916be04f26440d234de1e9a29dbf2155d03fa9ad2a .ray_b || exit 1
# Ray's workers (the replicas) start with the driver's environment: the same import path.
export PYTHONPATH=$PYTHONPATH:$SITE PATH=$SITE/bin:$PATH RAY_USAGE_STATS_ENABLED=0
