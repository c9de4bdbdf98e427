"""The talker's FP8 weights: what `quantization: fp8` turns to e4m3 at load (models/fp8.py)."""

from __future__ import annotations

from ..models.depth_decoder import DepthDecoder
from ..models.fp8 import quantize_linears, quantize_parameter
from ..models.language_model import LanguageModel


def quantize_talker(lm: LanguageModel, depth: DepthDecoder) -> None:
    """In place: every linear layer of the backbone (qkv, o, gate_up, down), its restricted head, and the depth
    decoder's projection, blocks and heads, as e4m3 with a float32 scale per output channel. Embeddings, norms and
    the KV cache keep their dtype; the bf16 weights are dropped (one-way)."""
    quantize_linears(lm)
    quantize_linears(depth)
    quantize_parameter(depth, "heads")
