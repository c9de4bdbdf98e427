"""GPU kernels (Triton, imported lazily) with pure-torch fallbacks for CPU-only machines."""

from .decode_attention import decode_attention, decode_attention_reference, triton_available

__all__ = ["decode_attention", "decode_attention_reference", "triton_available"]
