"""Programmatic dependent launch (PDL, CUDA capability 9.0+): a kernel launched with it may start on the SMs while
the kernel before it on the stream finishes, so launch latency and the first weight loads overlap that kernel's
tail instead of following it. The talker's frame step is ~740 small kernels (272 of them GEMMs reading each
weight once), where that gap is a measurable share of the step (docs/performance.md).

What keeps a chain of such kernels ordered: every PDL kernel lets its successor start (``gdc_launch_dependents``)
only after its own ``gdc_wait``, which returns once the kernel before it has finished and its memory is visible.
So a kernel that has started knows the kernel two places before it has finished. Ours read nothing but constant
data (weights) and write nothing before the wait; inductor's generated kernels read, before it, only buffers the
previous kernel of their graph did not write (and wait first after any non-generated kernel).

``MUSIC3SERVE_PDL`` chooses: ``all`` (default) for our Triton kernels and inductor's generated ones, ``ours`` for
ours only, ``off`` for none (to rule it out when a driver misbehaves, or to measure it). Set it before the
process starts: eager launches read it each time, but captured graphs keep the choice made at capture, and
inductor's when the hot paths compile.
"""

from __future__ import annotations

import functools

import torch

from ..pdl_setting import pdl_mode


def uses_pdl(device: torch.device) -> bool:
    """Whether our Triton kernels on this device launch with PDL (NVIDIA, capability 9.0+, a Triton that has it)."""
    return device.type == "cuda" and pdl_mode() != "off" and _supported(device.index or 0)


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch keyword for a Triton kernel call: none without PDL (older Triton rejects the keyword)."""
    return {"launch_pdl": True} if pdl else {}


def inductor_pdl() -> bool:
    """Whether inductor's generated kernels should use PDL (it checks the device's capability itself)."""
    return pdl_mode() == "all"


@functools.cache
def _supported(device_index: int) -> bool:
    if torch.version.hip is not None or torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401 (Triton 3.4+)
    except ImportError:
        return False
    return True
