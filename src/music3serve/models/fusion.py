"""Hot-path functions that inductor may fuse: plain functions, compiled together by `enable_fusion()`.

At 2-16 rows the talker step is bound by kernel count (norms, RoPE, SwiGLU, sampling), not by bytes; the
decorated functions hold exactly those elementwise chains around the GEMMs. Weights are arguments, so
one compiled graph serves every layer. Eager behaviour is unchanged until `enable_fusion()` is called.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch
import torch._inductor.config

from ..kernels.pdl import inductor_pdl

F = TypeVar("F", bound=Callable)
_plain: dict[str, Callable] = {}
_fused: dict[str, Callable] = {}


def hot(fn: F) -> F:
    """Register fn as fusable; calls go to its compiled version once fusion is enabled."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    _plain[name] = fn

    @functools.wraps(fn)
    def dispatch(*args, **kwargs):
        return _fused.get(name, fn)(*args, **kwargs)

    return dispatch  # type: ignore[return-value]


def enable_fusion(backend: str = "inductor", mode: str | None = None) -> None:
    """Compile every registered function (dynamic shapes, no graph breaks). Tests pass backend="aot_eager" to
    trace exactly as inductor would see the functions, without generating code; `mode` is torch.compile's
    (bench/dit_autotune.py tries "max-autotune-no-cudagraphs")."""
    # Keep the intermediate bf16 roundings the eager code (and the reference) performs.
    torch._inductor.config.emulate_precision_casts = True
    if hasattr(torch._inductor.config.triton, "enable_pdl"):  # generated kernels launch early too (kernels/pdl.py)
        torch._inductor.config.triton.enable_pdl = inductor_pdl()
    for name, fn in _plain.items():
        _fused.setdefault(name, torch.compile(fn, backend=backend, mode=mode, dynamic=True, fullgraph=True))


def disable_fusion() -> None:
    _fused.clear()


def fusion_enabled() -> bool:
    return bool(_fused)
