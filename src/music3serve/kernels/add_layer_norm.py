"""The DiT's residual update and the layer norm after it, in one pass over each row.

``s = x + delta`` (the residual stream and the output of the layer before, in the dtype torch's promotion gives)
and ``h = layer_norm(s.to(weight.dtype)) -> out_dtype`` (the next GEMM's input). Inductor turns this pair into a
looped reduction that reads each 2048-wide row twice (at ~48% of copy bandwidth on the H200: 16.6 us per call
for one window, measured 2026-11-30); here one Triton program holds a whole row in registers, reads
x and delta once and writes s and h once. float32 statistics; the mean and variance are summed in another order
than torch's, so h may differ from `F.layer_norm` in the last bits (GPU tests bound it). A custom op
(``music3serve::add_layer_norm``), so the DiT's compiled hot paths call it whole; the torch ops run on the CPU,
without Triton, and for rows wider than ``MAX_WIDTH``. ``add_layer_norm_fp8`` casts h to e4m3 per row in the same
pass, for the FP8 policy's GEMMs (kernels/row_quant.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.fp8 import E4M3, Fp8Rows, quantize_rows
from .decode_attention import triton_available
from .row_quant import quantize_row_kernel

__all__ = ["MAX_WIDTH", "add_layer_norm", "add_layer_norm_fp8", "add_layer_norm_reference", "uses_kernel"]

MAX_WIDTH = 8192


def add_layer_norm_reference(
    x: Tensor, delta: Tensor | None, weight: Tensor, bias: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The torch ops: (x + delta, layer_norm((x + delta) in weight's dtype), cast to out_dtype)."""
    s = x if delta is None else x + delta
    h = F.layer_norm(s.to(weight.dtype), (s.shape[-1],), weight, bias, eps)
    return s, h.to(out_dtype)


def uses_kernel(x: Tensor, weight: Tensor, bias: Tensor, out_dtype: torch.dtype) -> bool:
    """Whether add_layer_norm runs the Triton kernel for these operands: the bf16 policy's float32 norms feeding
    low-precision GEMMs on CUDA. Callers in compiled code decide with it outside the trace and inline
    add_layer_norm_reference otherwise, so inductor fuses that path (the float32 reference policy) as before."""
    return (
        x.is_cuda and triton_available() and x.shape[-1] <= MAX_WIDTH and out_dtype != torch.float32
        and weight.dtype == bias.dtype == torch.float32 and weight.shape == bias.shape == (x.shape[-1],)
    )


@torch.library.custom_op("music3serve::add_layer_norm", mutates_args=())
def add_layer_norm(
    x: Tensor, delta: Tensor | None, weight: Tensor, bias: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(s, h): s = x + delta (x if delta is None), h = layer_norm(s.to(weight.dtype)).to(out_dtype) over the last
    dim; the Triton kernel for CUDA rows with float32 norm weights and a low-precision out_dtype (the DiT under the
    bf16 policy), add_layer_norm_reference otherwise."""
    if not _runs_kernel(x, delta, weight, bias, out_dtype):
        return _reference_outputs(x, delta, weight, bias, eps, out_dtype)
    return _launch(x, delta, weight, bias, eps, out_dtype)[:2]


def _runs_kernel(x: Tensor, delta: Tensor | None, weight: Tensor, bias: Tensor, out_dtype: torch.dtype) -> bool:
    """The ops' choice: the kernel where `uses_kernel` says so and delta (if any) is shaped as x."""
    return uses_kernel(x, weight, bias, out_dtype) and (delta is None or delta.shape == x.shape)


def _reference_outputs(
    x: Tensor, delta: Tensor | None, weight: Tensor, bias: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """add_layer_norm_reference as new contiguous tensors (a custom op's outputs never alias its inputs)."""
    s, h = add_layer_norm_reference(x, delta, weight, bias, eps, out_dtype)
    return s.clone(memory_format=torch.contiguous_format) if delta is None else s.contiguous(), h.contiguous()


def _sum_dtype(x: Tensor, delta: Tensor | None) -> torch.dtype:
    return x.dtype if delta is None else torch.promote_types(x.dtype, delta.dtype)


def _launch(
    x: Tensor, delta: Tensor | None, weight: Tensor, bias: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The kernel's (s, h, None), or for out_dtype e4m3 (s, codes of h in bf16, their row scales [..., 1])."""
    width = x.shape[-1]
    s_dtype = _sum_dtype(x, delta)
    rows = x.numel() // width
    x2 = x.reshape(rows, width).contiguous()
    d2 = x2 if delta is None else delta.reshape(rows, width).contiguous()
    s = torch.empty(rows, width, dtype=s_dtype, device=x.device)
    h = torch.empty(rows, width, dtype=out_dtype, device=x.device)
    quant = out_dtype == E4M3
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device) if quant else None
    block = 1 << (width - 1).bit_length()
    _kernel()[(rows,)](
        x2, d2, weight.contiguous(), bias.contiguous(), s, h, h if scale is None else scale, width, eps, BLOCK=block,
        DELTA=delta is not None, QUANT=quant, num_warps=min(16, max(4, block // 256)),
    )
    return s.view(x.shape), h.view(x.shape), None if scale is None else scale.view(*x.shape[:-1], 1)


@add_layer_norm.register_fake
def _(x, delta, weight, bias, eps, out_dtype):
    return x.new_empty(x.shape, dtype=_sum_dtype(x, delta)), x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("music3serve::add_layer_norm_fp8", mutates_args=())
def _add_layer_norm_fp8(
    x: Tensor, delta: Tensor | None, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    if not _runs_kernel(x, delta, weight, bias, torch.bfloat16):
        s, h = _reference_outputs(x, delta, weight, bias, eps, torch.bfloat16)
        return (s, *(t.contiguous() for t in quantize_rows(h)))
    return _launch(x, delta, weight, bias, eps, E4M3)


@_add_layer_norm_fp8.register_fake
def _(x, delta, weight, bias, eps):
    return (x.new_empty(x.shape, dtype=_sum_dtype(x, delta)), x.new_empty(x.shape, dtype=E4M3),
            x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))


def add_layer_norm_fp8(
    x: Tensor, delta: Tensor | None, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Fp8Rows]:
    """(s, quantize_rows(h)) for the bf16 h of add_layer_norm: the FP8 GEMM's input, cast in the same pass."""
    s, codes, scale = _add_layer_norm_fp8(x, delta, weight, bias, eps)
    return s, Fp8Rows(codes, scale)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    quantize_row = quantize_row_kernel()

    @triton.jit
    def add_layer_norm_kernel(x_ptr, d_ptr, w_ptr, b_ptr, s_ptr, h_ptr, scale_ptr, width, eps,
                              BLOCK: tl.constexpr, DELTA: tl.constexpr, QUANT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        s = tl.load(x_ptr + row * width + cols, mask=ok, other=0.0)
        if DELTA:
            d = tl.load(d_ptr + row * width + cols, mask=ok, other=0.0)
            # torch's x + delta: both operands in the promoted dtype, one rounding to it
            s = (s.to(tl.float32) + d.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * width + cols, s, mask=ok)
        v = s.to(tl.float32)  # the norm's input in its weight dtype (float32)
        mean = tl.sum(v, axis=0) / width
        centered = tl.where(ok, v - mean, 0.0)
        var = tl.sum(centered * centered, axis=0) / width
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        b = tl.load(b_ptr + cols, mask=ok, other=0.0)
        h = centered * rstd * w + b
        if QUANT:  # h rounded to bf16 (the FP8 GEMM's compute dtype), then cast per row
            codes, scale = quantize_row(h.to(tl.bfloat16).to(tl.float32), ok)
            tl.store(h_ptr + row * width + cols, codes, mask=ok)
            tl.store(scale_ptr + row, scale)
        else:
            tl.store(h_ptr + row * width + cols, h.to(h_ptr.dtype.element_ty), mask=ok)

    return add_layer_norm_kernel
