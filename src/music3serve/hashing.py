"""A 32-bit integer hash for counter-based random draws, on Python ints and on int64 tensors alike."""

from __future__ import annotations

from typing import TypeVar

import torch

MASK32 = 0xFFFFFFFF
Int = TypeVar("Int", int, torch.Tensor)


def as_int64(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (two's complement), to sit in an int64 tensor: the
    hashes read it back bit for bit (masks and shifts of its two 32-bit halves), so values below 2**63 are unchanged."""
    return value - (1 << 64) if value >= 1 << 63 else value


def mul32(x: Int, constant: int) -> Int:
    """(x * constant) mod 2**32 for 32-bit values (held in int64 tensors: without int64 overflow)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix32(x: Int) -> Int:
    """A 32-bit integer hash with full avalanche (xor-shift-multiply rounds); mix32(0) == 0."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)
