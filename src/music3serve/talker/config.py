"""The talker engine's settings: rows, context, prefill budget, CUDA graphs and the memory share it may take."""

from __future__ import annotations

from dataclasses import dataclass

from .. import contract


@dataclass(frozen=True)
class TalkerConfig:
    max_num_seqs: int = 16  # rows: two per song
    max_model_len: int = contract.MAX_CONTEXT
    max_num_batched_tokens: int = contract.MAX_CONTEXT  # prompt tokens prefilled per step, both rows counted
    capture_sizes: tuple[int, ...] = (2, 4, 8, 16)
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.6
    fuse: bool = True  # on CUDA, compile the hot elementwise chains (models/fusion.py) before capture
    # Depth-decoder calls on cached keys instead of recomputing all positions (models/depth_decoder.py): fewer FLOPs,
    # and as fast or faster on the H200; with them, calls 2..7 of a frame look their new position and first q, k, v
    # up in a table built at startup (talker/depth_inputs.py, 201 MB at full size). Measured on the H200
    # (2026-11-30 and 2026-12-02).
    depth_cache: bool = True
