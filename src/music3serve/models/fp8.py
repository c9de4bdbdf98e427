"""FP8 (e4m3) weights with one float32 scale per output channel, and the arithmetic the FP8 kernels perform.

A weight W [..., N, K] is stored as q = e4m3(W / s) with s = amax(|W[n, :]|) / 448 per output row n, so the largest
entry of every row maps to e4m3's largest finite value (computed as amax times float32(1/448): the same bits on every
device and in the kernels). Two products use it:

- weight only (the talker): y = (x @ q.T) * s, x in its own dtype (bf16), float32 accumulation, one rounding to x's
  dtype at the end. e4m3 values are exact in bf16, so the product before the scale is the bf16 product of x by q;
  kernels/skinny_linear.py computes it for decode rows, `weight_only_reference` everywhere else.
- weight and activation (the DiT): every row of x scaled by its own t = amax(|x[m, :]|) / 448 and cast to e4m3 too,
  y = (e4m3(x / t) @ q.T) * t * s in float32, rounded to bf16: torch._scaled_mm's rowwise scaling on the GPU,
  `scaled_reference` on the CPU.

Quantization happens at load, from the checkpoint's weights (`quantize_linears`): the module's Linear layers become
`Fp8Linear`, whose `.weight` is an `Fp8Weight` that the models' `linear` functions dispatch on.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale (its codes are zero either way)
COMPUTE_DTYPE = torch.bfloat16  # the activations an FP8 layer takes and returns on the GPU


class Fp8Weight(NamedTuple):
    """e4m3 codes [..., N, K] and float32 scales [..., N]: weight = codes * scale[..., None]."""

    codes: Tensor
    scale: Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its inputs are cast to before the product: bf16 (what the FP8 kernels take)."""
        return COMPUTE_DTYPE


def quantize(weight: Tensor) -> Fp8Weight:
    """Per-output-channel e4m3 codes and float32 scales of weight [..., N, K]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=-1) * (1 / E4M3_MAX)).clamp_min(MIN_SCALE)
    codes = (w / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Fp8Weight(codes, scale)


def dequantize(weight: Fp8Weight, dtype: torch.dtype) -> Tensor:
    """codes * scale in float32, rounded to `dtype`."""
    return (weight.codes.float() * weight.scale[..., None]).to(dtype)


def weight_only_reference(x: Tensor, weight: Fp8Weight) -> Tensor:
    """(x @ codes.T) * scale with float32 accumulation, rounded once to x's dtype: the skinny kernel's arithmetic up to
    the order of its sums. On CUDA bf16 one bf16 GEMM with float32 output on the codes (exact in bf16), elsewhere
    float32 products."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda and rows.dtype == torch.bfloat16:
        y = torch.mm(rows, weight.codes.to(torch.bfloat16).T, out_dtype=torch.float32)
    else:
        y = rows.float() @ weight.codes.float().T
    return (y * weight.scale).to(x.dtype).view(*x.shape[:-1], weight.shape[0])


class Fp8Rows(NamedTuple):
    """Activations as e4m3 codes [..., K] and one float32 scale a row [..., 1]: x ~ codes * scale."""

    codes: Tensor
    scale: Tensor

    def matrix(self) -> tuple[Tensor, Tensor]:
        """codes [M, K] and scales [M, 1], the rows of every leading dimension stacked (a GEMM's operand)."""
        return self.codes.reshape(-1, self.codes.shape[-1]), self.scale.reshape(-1, 1)


def quantize_rows(x: Tensor) -> Fp8Rows:
    """Per-row e4m3 codes and float32 scales of activations x [..., K], by the weights' rule; kernels/row_quant.py
    computes the same bits."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() * (1 / E4M3_MAX)).clamp_min(MIN_SCALE)
    return Fp8Rows((x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale)


def as_fp8_rows(x: Tensor | Fp8Rows) -> Fp8Rows:
    return x if isinstance(x, Fp8Rows) else quantize_rows(x)


def scaled_reference(x: Tensor | Fp8Rows, weight: Fp8Weight, bias: Tensor | None = None) -> Tensor:
    """F.linear with both factors in e4m3 (x scaled per row unless given as codes), float32 products and scales, bf16
    out: what `scaled_linear` computes with torch._scaled_mm."""
    rows = as_fp8_rows(x)
    codes, scale = rows.matrix()
    y = (codes.float() @ weight.codes.float().T) * scale * weight.scale
    if bias is not None:
        y = y + bias.float()
    return y.to(COMPUTE_DTYPE).view(*rows.codes.shape[:-1], weight.shape[0])


def uses_scaled_mm(x: Tensor, weight: Fp8Weight) -> bool:
    """Whether scaled_linear runs torch._scaled_mm (CUDA, both dims multiples of 16) or the float32 reference."""
    n, k = weight.shape
    return x.is_cuda and n % 16 == 0 and k % 16 == 0


def scaled_linear(x: Tensor | Fp8Rows, weight: Fp8Weight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] (or its codes and row scales) times an FP8 weight [N, K] (the DiT's linear layers), bf16 out."""
    rows = as_fp8_rows(x)
    if not uses_scaled_mm(rows.codes, weight):
        return scaled_reference(rows, weight, bias)
    codes, scale = rows.matrix()
    y = torch._scaled_mm(codes, weight.codes.T, scale_a=scale, scale_b=weight.scale[None, :], out_dtype=COMPUTE_DTYPE)
    if bias is not None:
        y = y + bias.to(COMPUTE_DTYPE)
    return y.view(*rows.codes.shape[:-1], weight.shape[0])


class Fp8Linear(nn.Module):
    """A Linear (or a stack of them, [..., N, K]) whose weight is held as `Fp8Weight` buffers; bias, if any, kept.
    `forward` multiplies weight and activations in FP8 (scaled_linear); the talker's functions read `.weight`."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        quantized = quantize(weight)
        self.register_buffer("codes", quantized.codes)
        self.register_buffer("scale", quantized.scale)
        self.bias = bias

    @property
    def weight(self) -> Fp8Weight:
        return Fp8Weight(self.codes, self.scale)

    def __getitem__(self, index: int) -> Fp8Weight:
        """The stacked weight `index` (e.g. one depth-decoder head)."""
        return Fp8Weight(self.codes[index], self.scale[index])

    def forward(self, x: Tensor) -> Tensor:
        return scaled_linear(x, self.weight, self.bias)


def quantize_linears(module: nn.Module, wanted: Callable[[str], bool] = lambda name: True) -> list[str]:
    """Replace (in place) every nn.Linear of `module` whose name `wanted` accepts by an Fp8Linear of its weight;
    returns their names. Idempotent: Fp8Linear layers are left as they are."""
    names = [name for name, m in module.named_modules() if type(m) is nn.Linear and wanted(name)]
    for name in names:
        layer = module.get_submodule(name)
        parent, _, attr = name.rpartition(".")
        module.get_submodule(parent).register_module(attr, Fp8Linear(layer.weight, layer.bias))
    return names


def quantize_parameter(module: nn.Module, name: str) -> None:
    """Replace (in place) a stacked weight parameter [..., N, K] of `module` by an Fp8Linear holding it."""
    param = getattr(module, name)
    if isinstance(param, Fp8Linear):
        return
    delattr(module, name)
    module.register_module(name, Fp8Linear(param))


def reference_linear(x: Tensor, weight: Tensor | Fp8Weight) -> Tensor:
    """F.linear, or for an FP8 weight its weight-only product (the torch ops the talker runs off the kernel)."""
    if isinstance(weight, Fp8Weight):
        return weight_only_reference(x, weight)
    return F.linear(x, weight)
