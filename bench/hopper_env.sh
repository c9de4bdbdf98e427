# Sourced by bench/gpu_all.sh (and any script that needs the `hopper` extra) on a GPU machine without network access:
# bench/gpu_env.sh, then the CuTe-DSL wheels (quack-kernels, nvidia-cutlass-dsl) installed once per machine into a
# site-packages folder (quack keys its compile cache by the functions it finds outside site-packages, and fails on the
# DSL's own). The DSL's 92 MB cu13 wheel is over one copy's 64 MiB: bench/hopper_stash.sh leaves its first part on the
# machine (.cute_a copied along), and the next run has the rest in .cute_b with the other wheels.
source bench/gpu_env.sh
SITE=/tmp/cute_env/lib/python3.12/site-packages
WHEEL=/tmp/cute/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
install_split_wheel $SITE quack $WHEEL /tmp/cute/libs_cu13.part_aa .cute_b/libs_cu13.part_ab \
  50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90 .cute_b || exit 1
# A --target install runs no .pth file: the DSL's puts its dsl_packages folder on the path.
export PYTHONPATH=$PYTHONPATH:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
