"""Programmatic dependent launch (PDL, CUDA capability 9.0+): a kernel launched with it may start on the SMs while
the kernel before it on the stream finishes, so launch latency and the first weight loads overlap that kernel's
tail instead of following it. The talker's frame step is ~740 small kernels (272 of them GEMMs reading each
weight once), where that gap is a measurable share of the step (docs/performance.md, session 5).

The rule every PDL kernel here keeps, so a chain of them stays ordered: it reads nothing another kernel writes
and writes nothing before ``gdc_wait`` (which returns once the previous kernel has finished and its memory is
visible), and it lets its own successor start (``gdc_launch_dependents``) only after that wait. So a kernel that
has started knows the kernel two places before it has finished, and the kernel just before it once it waits.
Constant data (weights) may be touched before the wait.

``MUSIC3SERVE_PDL`` chooses: ``all`` (default) for our Triton kernels and inductor's generated ones, ``ours`` for
ours only, ``off`` for none (to rule it out when a driver misbehaves, or to measure it).
"""

from __future__ import annotations

import functools
import os

import torch

_MODES = ("all", "ours", "off")


def pdl_mode() -> str:
    mode = os.environ.get("MUSIC3SERVE_PDL", "all").strip().lower()
    if mode not in _MODES:
        raise ValueError(f"MUSIC3SERVE_PDL must be one of {', '.join(_MODES)}, got {mode!r}")
    return mode


def uses_pdl(device: torch.device) -> bool:
    """Whether our Triton kernels on this device launch with PDL."""
    return device.type == "cuda" and pdl_mode() != "off" and _capability_at_least_9(device.index or 0)


def inductor_pdl() -> bool:
    """Whether inductor's generated kernels should use PDL (it checks the device's capability itself)."""
    return pdl_mode() == "all"


@functools.cache
def _capability_at_least_9(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9
