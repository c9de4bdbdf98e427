"""A Triton launch with the most pipeline stages that fit the GPU's shared memory. The skinny GEMM's tiles are
measured at 16-row programs; at 32 rows a stage holds twice the x tile, and Triton widens e4m3 weights through shared
memory, so a tile may need fewer stages there. Fewer stages only shorten how far the loads run ahead of the
arithmetic: a row's bits stay the tile's."""

from __future__ import annotations

from typing import Callable

# The stages each launch key ran with: fewer than asked where those did not fit.
STAGES_THAT_FIT: dict[tuple, int] = {}


def launch_fitting(launch: Callable[..., object], stages: int, key: tuple) -> None:
    """launch(num_stages=...) with `stages`, or the most below it that fit (remembered under `key`)."""
    stages = STAGES_THAT_FIT.get(key, stages)
    while True:
        try:
            launch(num_stages=stages)
        except Exception as exc:  # Triton raises OutOfResources when it loads the compiled kernel, before it runs
            if stages == 1 or not _out_of_resources(exc):
                raise
            stages -= 1
            continue
        STAGES_THAT_FIT[key] = stages
        return


def _out_of_resources(exc: Exception) -> bool:
    from triton.runtime.errors import OutOfResources  # importable: Triton raised it

    return isinstance(exc, OutOfResources)
