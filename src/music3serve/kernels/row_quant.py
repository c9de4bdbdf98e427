"""Activations cast to e4m3 with one scale a row, for the DiT's FP8 GEMMs.

torch._scaled_mm takes its input as e4m3 codes and a float32 scale per row (models/fp8.py, `quantize_rows`).
Compiled by inductor as its own pass, that cast is a looped reduction: 77 us for the eight-window DiT's [11040, 2048]
input on the H100, 3.4x its read-and-write floor (bench/profile_gpu.py dit-fp8, 2026-12-06). Two places do better:
kernels/add_layer_norm.py casts the norm it holds in registers (`quantize_row`: no pass of its own), and `fp8_rows`
casts the attention's output, one program a row reading it in chunks twice (its amax, then its codes; the second
pass mostly from L2). The feed-forward's gated projection is left to inductor, which fuses the cast with the bias and
the gate (faster there than this kernel after them, measured).

The arithmetic is `quantize_rows`' bit for bit (the scale as one float32 multiply, IEEE divisions, rounding to
nearest even). A custom op: the DiT's compiled hot paths call it whole; the torch ops run on the CPU.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..models.fp8 import E4M3, Fp8Rows, quantize_rows
from .decode_attention import triton_available

__all__ = ["fp8_rows", "quantize_row_kernel", "uses_kernel"]


def uses_kernel(x: Tensor) -> bool:
    """Whether the ops run their Triton kernels for x: bf16 rows on CUDA."""
    return x.is_cuda and triton_available() and x.dtype == torch.bfloat16


@torch.library.custom_op("music3serve::fp8_rows", mutates_args=())
def _fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    if not uses_kernel(x):
        return tuple(t.contiguous() for t in quantize_rows(x))
    width = x.shape[-1]
    rows = x.numel() // width
    codes = torch.empty(rows, width, dtype=E4M3, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _kernels()[1][(rows,)](x.reshape(rows, width).contiguous(), codes, scale, width, CHUNK=2048, num_warps=4)
    return codes.view(x.shape), scale.view(*x.shape[:-1], 1)


@_fp8_rows.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def fp8_rows(x: Tensor) -> Fp8Rows:
    """quantize_rows(x): the kernel for bf16 CUDA rows, the torch ops otherwise."""
    return Fp8Rows(*_fp8_rows(x))


def quantize_row_kernel():
    """The @triton.jit function (v, ok) -> (codes, scale): a float32 row's e4m3 codes and scale, lanes not `ok`
    ignored (kernels/add_layer_norm.py calls it on the norm it computes)."""
    return _kernels()[0]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def row_scale(amax, nan):
        # quantize_rows: max(amax|v| * (1 / 448), 1e-12); a NaN anywhere makes it NaN, as torch's amax does.
        scale = tl.maximum(amax * (1.0 / 448.0), 1e-12)
        return tl.where(nan > 0, float("nan"), scale)

    @triton.jit
    def e4m3_codes(v, scale):
        return tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)

    @triton.jit
    def quantize_row(v, ok):
        amax = tl.max(tl.where(ok, tl.abs(v), 0.0), axis=0)
        scale = row_scale(amax, tl.max(tl.where(ok & (v != v), 1, 0), axis=0))
        return e4m3_codes(v, scale), scale

    @triton.jit
    def row_quant_kernel(x_ptr, codes_ptr, scale_ptr, width, CHUNK: tl.constexpr):
        # Two passes over the row in chunks, the second mostly from L2: small programs, many of them on each SM.
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.arange(0, CHUNK)
        amax = tl.zeros([CHUNK], tl.float32)
        nan = tl.zeros([CHUNK], tl.int32)
        for start in range(0, width, CHUNK):
            ok = start + chunk < width
            v = tl.load(x_ptr + row * width + start + chunk, mask=ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.where(ok, tl.abs(v), 0.0))
            nan = tl.maximum(nan, tl.where(ok & (v != v), 1, 0))
        scale = row_scale(tl.max(amax, axis=0), tl.max(nan, axis=0))
        for start in range(0, width, CHUNK):
            ok = start + chunk < width
            v = tl.load(x_ptr + row * width + start + chunk, mask=ok, other=0.0).to(tl.float32)
            tl.store(codes_ptr + row * width + start + chunk, e4m3_codes(v, scale), mask=ok)
        tl.store(scale_ptr + row, scale)

    return quantize_row, row_quant_kernel
