"""What a stage may hold: its share of a CUDA card, or this machine's memory on the CPU (startup checks)."""

from __future__ import annotations

import os

import torch

GIB = 1 << 30


def module_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the modules' parameters and buffers, on whatever device (meta included) they are."""
    return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))


def host_memory() -> int:
    """Bytes of physical memory of this machine."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def card_share(device: torch.device, share: float) -> tuple[float, str]:
    """Bytes that gpu_memory_utilization `share` of the CUDA card at `device` allows, and how errors say it."""
    allowed = share * torch.cuda.get_device_properties(device).total_memory
    return allowed, f"gpu_memory_utilization {share} of the card ({allowed / GIB:.1f} GiB)"
