"""value * silu(gate) of the DiT's feed-forward input projection, its rows stored in (gate, value) pairs.

The checkpoint stores ff_in's rows as [value; gate] halves. `pair_rows` interleaves them as (gate_0, value_0,
gate_1, value_1, ...), the layout of quack-kernels' gated GEMM: on Hopper, with the `hopper` extra installed, for
bf16 operands and at least ``MIN_ROWS`` rows, `glu_linear` is that one GEMM, which applies SiLU and the product to
the float32 accumulator in its epilogue and rounds once, so the [rows, 2 * ff] projection never reaches memory
(docs/performance.md). Elsewhere `glu` runs the torch ops on the projection's columns, rounding after
each op as the checkpoint-layout code does. A custom op (``music3serve::glu_linear``), so the DiT's compiled hot
path calls it whole. quack compiles its kernel on first use (the renderer's warm-up renders two windows at once for
it); should that fail, the call falls back to the torch ops, logs why, and the process keeps the gate pass.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import install_hint

__all__ = ["MIN_ROWS", "glu", "glu_linear", "pair_rows", "quack_import_error", "unavailable_reason", "unpair_rows",
           "uses_kernel"]

# Below this many rows (cond + uncond of one window: 1380) cuBLAS plus the separate gate pass is faster.
MIN_ROWS = 2048
log = logging.getLogger(__name__)
_failure: str | None = None  # why quack's GEMM failed in this process, if it did: it is not tried again
# quack's tile M x N, ping-pong (or cooperative), cluster size along M: the fastest at four windows (478 us against
# 528-600), within 1.3% of the fastest tile at two and eight (docs/performance.md).
TILE = (128, 192, True, 2)


def pair_rows(t: Tensor) -> Tensor:
    """Rows [value; gate] (two halves along dim 0) reordered as (gate_i, value_i) pairs."""
    value, gate = t.chunk(2, dim=0)
    return torch.stack((gate, value), dim=1).flatten(0, 1)


def unpair_rows(t: Tensor) -> Tensor:
    """pair_rows undone: the [value; gate] halves of the checkpoint."""
    return torch.cat((t[1::2], t[0::2]))


def glu(projection: Tensor, pairs: bool) -> Tensor:
    """value * silu(gate) from a projection whose last dim holds (gate, value) pairs, or [value, gate] halves."""
    if pairs:
        gate, value = projection[..., 0::2], projection[..., 1::2]
    else:
        value, gate = projection.chunk(2, dim=-1)
    return value * F.silu(gate)


@functools.cache
def quack_import_error() -> str | None:
    """Why quack-kernels cannot be used here (None: it imports)."""
    try:
        importlib.import_module("quack.gemm_interface")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "quack":
            return f"quack-kernels is not installed ({install_hint('hopper')})"
        return f"quack-kernels does not import: {exc}"
    except Exception as exc:  # a broken install: a CUTLASS DSL without its CUDA libraries, say
        return f"quack-kernels does not import: {type(exc).__name__}: {exc}"
    return None


def unavailable_reason(weight: Tensor) -> str | None:
    """Why glu_linear cannot fuse the gate for this weight at any row count (None: the device and the library allow
    it; uses_kernel adds the row count, the alignment and the bias)."""
    if not weight.is_cuda or torch.cuda.get_device_capability(weight.device)[0] != 9:
        return "not a Hopper GPU"
    if weight.dtype != torch.bfloat16:
        return f"{weight.dtype} weights, not bf16"
    return _failure or quack_import_error()


def uses_kernel(rows: int, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether glu_linear runs quack's fused GEMM on `rows` rows of input in weight's dtype and device: a bf16
    weight on a Hopper device, at least MIN_ROWS rows, 16-byte aligned rows in and out, and quack importable."""
    n, k = weight.shape
    return (
        rows >= MIN_ROWS and k % 8 == 0 and n % 16 == 0
        and (bias is None or (bias.dtype == weight.dtype and bias.shape == (n,) and bias.device == weight.device))
        and unavailable_reason(weight) is None
    )


@torch.library.custom_op("music3serve::glu_linear", mutates_args=())
def glu_linear(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """glu(F.linear(h, weight, bias), pairs=True) for `weight` [2 * ff, width] in pairs: quack's fused GEMM where
    uses_kernel says so, the torch ops otherwise."""
    k = weight.shape[1]
    if h.dtype != weight.dtype or h.device != weight.device or h.shape[-1] != k or not uses_kernel(
            h.numel() // k, weight, bias):
        return _gate_pass(h, weight, bias)
    try:
        out = quack_gated_gemm(h.reshape(-1, k).contiguous(), weight, bias, TILE)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # its compile, on first use (the renderer's warm-up): fall back for good
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        global _failure
        _failure = f"quack's GEMM failed: {type(exc).__name__}: {exc}"
        log.warning("the fused feed-forward gate failed; the gate runs as a separate pass from now on",
                    extra={"reason": _failure})
        return _gate_pass(h, weight, bias)
    return out.view(*h.shape[:-1], weight.shape[0] // 2)


def quack_gated_gemm(rows: Tensor, weight: Tensor, bias: Tensor | None, tile: tuple[int, int, bool, int]) -> Tensor:
    """quack's GEMM of rows [m, width] by `weight` in pairs with the SwiGLU epilogue, on `tile` (as TILE), untuned."""
    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import gemm_act

    tile_m, tile_n, pingpong, cluster_m = tile
    config = GemmConfig(tile_m=tile_m, tile_n=tile_n, pingpong=pingpong, cluster_m=cluster_m, cluster_n=1,
                        is_dynamic_persistent=False, device_capacity=9)
    return gemm_act(rows, weight.T, bias=bias, activation="swiglu", store_preact=False, tuned=False, config=config)[1]


def _gate_pass(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The torch ops, in a new tensor (a custom op's output never aliases its inputs)."""
    return glu(F.linear(h, weight, bias), pairs=True).contiguous()


@glu_linear.register_fake
def _(h, weight, bias):
    return h.new_empty(*h.shape[:-1], weight.shape[0] // 2)
