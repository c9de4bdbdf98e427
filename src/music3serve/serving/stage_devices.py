"""Which device each stage of an engine runs on: the deploy file's `devices`, a device override, or the CPU."""

from __future__ import annotations

import logging

import torch

from ..errors import Music3Error
from .deploy_schema import DeployConfig

log = logging.getLogger("music3serve.serving.engine")  # the engine's lines, under the name users filter on


def stage_devices(deploy: DeployConfig, device: str | torch.device | None) -> tuple[str, str]:
    """Stage 0's and stage 1's devices: the GPUs `devices` name (checked against this machine), both on `device`
    when it overrides them, or both on the CPU without CUDA."""
    s0, s1 = deploy.stages
    if device is None and torch.cuda.is_available():
        count = torch.cuda.device_count()
        for name, stage in (("stage 0", s0), ("stage 1", s1)):
            if stage.devices[0] >= count:
                raise Music3Error(f"{name} is placed on GPU {stage.devices[0]} (deploy config `devices`), but "
                                  f"this machine has {count} CUDA device(s): 0 to {count - 1}")
        device0, device1 = (f"cuda:{s.devices[0]}" for s in (s0, s1))
    elif device is None:
        device0 = device1 = "cpu"
        log.warning("no CUDA device: both stages run on the CPU in this process (deploy `devices` ignored)")
    else:
        try:
            device0 = device1 = str(torch.device(device))
        except (RuntimeError, TypeError) as e:
            raise Music3Error(f"device override {device!r} is not a torch device ({e})") from None
        shares = s0.gpu_memory_utilization + s1.gpu_memory_utilization
        if torch.device(device).type == "cuda" and shares > 1:  # the file's own check saw two GPUs
            raise Music3Error(f"both stages run on {device} (the device override), but their deploy config "
                              f"gpu_memory_utilization add up to {shares:g} > 1: lower them, or leave the stages "
                              "on the GPUs their `devices` name")
    return device0, device1
