"""Operands and checks shared by the row cast's tests on the CPU (tests/test_fp8.py), under Triton's interpreter
(tests/kernels_interpreted) and on the GPU (tests/test_fp8_gpu.py): kernels/row_quant.py and add_layer_norm_fp8."""

from __future__ import annotations

import torch

from music3serve.models.fp8 import Fp8Rows


def rows_to_cast(rows: int, width: int, device: str, seed: int = 0) -> torch.Tensor:
    """bf16 rows [2, rows, width] of every kind the cast meets: magnitudes from 1e-4 to 1e3 (codes down in e4m3's
    subnormal range), a row of zeros (the smallest scale), a row holding a NaN (every code NaN, as torch's amax)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, width, generator=gen)
    x *= 10.0 ** torch.randint(-4, 4, (2, rows, 1), generator=gen)
    x[0, 0] *= torch.linspace(1e-3, 1, width)  # one row spanning e4m3's whole range
    x[1, 0] = 0.0
    if rows > 1:
        x[1, 1, width // 2] = float("nan")
    return x.to(device, torch.bfloat16)


def assert_same_rows(got: Fp8Rows, want: Fp8Rows) -> None:
    """The same codes, bit for bit (NaN codes included), and the same scales."""
    assert got.codes.dtype == want.codes.dtype and got.codes.shape == want.codes.shape
    assert got.scale.shape == want.scale.shape == (*want.codes.shape[:-1], 1)
    assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
    assert torch.equal(got.scale.isnan(), want.scale.isnan())
    assert torch.equal(got.scale.nan_to_num(), want.scale.nan_to_num())
