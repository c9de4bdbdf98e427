"""GPU kernels (Triton, imported lazily) with pure-torch fallbacks for CPU-only machines."""

from .decode_attention import decode_attention, triton_available
from .decode_attention_reference import decode_attention_reference

__all__ = ["decode_attention", "decode_attention_reference", "triton_available"]
