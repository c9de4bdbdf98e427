"""The talker's memory check at startup: its weights, lookup tables, KV slots and frame conditioning must fit."""

from __future__ import annotations

from .. import contract
from ..errors import Music3Error
from ..memory import GIB, card_share, host_memory, module_bytes
from ..models.depth_decoder import DepthDecoder
from ..models.language_model import LanguageModel
from .config import TalkerConfig
from .depth_inputs import DepthInputs
from .slots import SlotCache


def device_bytes(lm: LanguageModel, depth: DepthDecoder, config: TalkerConfig) -> int:
    """The weights and lookup tables the talker keeps on its device, whatever the songs."""
    return module_bytes(lm, depth) + (DepthInputs.bytes_needed(depth) if config.depth_cache else 0)


def row_bytes(lm: LanguageModel, pairs: int, config: TalkerConfig) -> tuple[int, int]:
    """The KV slots of `pairs` songs and their frame conditioning buffers, in bytes."""
    kv = SlotCache.bytes_needed(lm.cfg, pairs, config.max_model_len, lm.embed.weight.dtype)
    frames = contract.frame_budget(contract.MAX_FRAMES, 1, config.max_model_len) + 1  # the longest budget + 1
    return kv, pairs * frames * lm.cfg.hidden * 4  # conditioning: float32, one buffer per decoding song


def check_memory(lm: LanguageModel, depth: DepthDecoder, pairs: int, config: TalkerConfig) -> None:
    """Weights, KV slots and the decoding songs' frame conditioning must fit in gpu_memory_utilization of the card on
    CUDA, and the KV slots and conditioning in the machine's memory on the CPU, or startup fails with the numbers."""
    device = lm.embed.weight.device
    weights = device_bytes(lm, depth, config)
    kv, conditioning = row_bytes(lm, pairs, config)
    needs = (f"{kv / GIB:.1f} GiB of KV for {2 * pairs} rows of {config.max_model_len} tokens + "
             f"{conditioning / GIB:.1f} GiB of frame conditioning for {pairs} songs")
    rows = kv + conditioning
    if device.type == "cuda":
        allowed, share = card_share(device, config.gpu_memory_utilization)
        if weights + rows > allowed:
            raise Music3Error(f"talker needs {weights / GIB:.1f} GiB of weights and lookup tables + {needs}, more than "
                              f"{share}: lower max_num_seqs or max_model_len, or raise the fraction")
    elif device.type == "cpu" and rows > (memory := host_memory()):
        raise Music3Error(f"talker needs {needs}, more than this machine's {memory / GIB:.1f} GiB of memory: lower "
                          "max_num_seqs or max_model_len")
