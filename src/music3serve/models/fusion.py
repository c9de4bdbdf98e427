"""Hot-path functions that inductor may fuse: plain functions, compiled together by `enable_fusion()`.

At 2-16 rows the talker step is bound by kernel count (norms, RoPE, SwiGLU, sampling), not by bytes; the
decorated functions hold exactly those elementwise chains around the GEMMs. Weights are arguments, so
one compiled graph serves every layer. Eager behaviour is unchanged until `enable_fusion()` is called.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch
import torch._dynamo.config
import torch._inductor.config
import torch.fx.experimental._config
from torch.torch_version import TorchVersion

from ..kernels.pdl import inductor_pdl


def shared_shape_settings(torch_version: str) -> dict[str, bool]:
    """torch.fx.experimental._config's settings for graphs shared across sizes. Size-oblivious sizes from torch 2.13
    on: 2.11's inductor fails to lower slices of them (KeyError 'unbacked_bindings' on CUDA), so there a size of one
    compiles graphs of its own, as by dynamo's default; the talker gives its hot paths none (talker/step.py,
    layers.as_tokens)."""
    oblivious = TorchVersion(torch_version) >= "2.13"
    return {"use_duck_shape": False, **({"backed_size_oblivious": True} if oblivious else {})}


F = TypeVar("F", bound=Callable)
_plain: dict[str, Callable] = {}
_fused: dict[str, Callable] = {}
_between_library_calls: set[str] = set()
RECOMPILE_LIMIT = 64
SHARED_SHAPE_SETTINGS = shared_shape_settings(torch.__version__)
_saved_settings: dict[tuple[object, str], object] = {}  # (torch config module, key): its value before enable_fusion
_enabled_with: tuple[str, str | None] | None = None  # enable_fusion's (backend, mode) while fusion is on


def _name(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def hot(fn: F) -> F:
    """Register fn as fusable; calls go to its compiled version once fusion is enabled. Its graph serves every size
    of its inputs, one included (share_graphs_across_sizes): never broadcast an input's dimension because it has
    size 1; make broadcast dimensions inside the function (`[:, None]`, `keepdim=True`)."""
    name = _name(fn)
    _plain[name] = fn

    @functools.wraps(fn)
    def dispatch(*args, **kwargs):
        return _fused.get(name, fn)(*args, **kwargs)

    return dispatch  # type: ignore[return-value]


def between_library_calls(fn: F) -> F:
    """Mark a hot function whose kernels sit between cuBLAS / cuDNN calls (the DiT's, the vocoder's): programmatic
    dependent launch (kernels/pdl.py) measured no gain there (docs/performance.md, tried and rejected); its kernels are
    generated without it."""
    _between_library_calls.add(_name(fn))
    return fn


def enable_fusion(backend: str = "inductor", mode: str | None = None) -> None:
    """Compile every registered function (dynamic shapes, no graph breaks). Tests pass backend="aot_eager" to
    trace exactly as inductor would see the functions, without generating code; `mode` is torch.compile's
    (bench/dit_autotune.py tries "max-autotune-no-cudagraphs"). Enabling again with the same arguments keeps the
    compiled functions and their graphs (the talker and the renderer each enable it); other arguments need
    disable_fusion first."""
    global _enabled_with
    if _enabled_with not in (None, (backend, mode)):
        raise RuntimeError(f"fusion is already enabled with backend and mode {_enabled_with}: disable_fusion() first")
    _enabled_with = (backend, mode)
    # Keep the intermediate bf16 roundings the eager code (and the reference) performs.
    _change(torch._inductor.config, "emulate_precision_casts", True)
    # Weights are parameters, whose shapes dynamo keeps static: each model width is one more compilation of every
    # hot function (backbone and depth decoder are two). Dynamo's default of 8 per function then fails a process that
    # builds engines for several checkpoints (the GPU tests do); a bounded number of widths is expected here.
    _change(torch._dynamo.config, "recompile_limit", max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT))
    share_graphs_across_sizes()
    for name, fn in _plain.items():
        if backend == "inductor":  # a mode is a set of options: merged with ours (torch.compile takes one or the other)
            options = {**(torch._inductor.list_mode_options(mode, True) if mode else {}), **_inductor_options(name)}
            compiled = torch.compile(fn, options=options, dynamic=True, fullgraph=True)
        else:
            compiled = torch.compile(fn, backend=backend, mode=mode, dynamic=True, fullgraph=True)
        _fused.setdefault(name, compiled)


def fusion_enabled() -> bool:
    """Whether hot paths run compiled: the engine then warms up every shape it serves (on the CPU too, where tests and
    `bench ready` enable fusion themselves), so that no song waits for a compile."""
    return bool(_fused)


def compiles_sizes_of_one() -> bool:
    """Whether the compiled hot paths would compile graphs of their own for a dimension of size one: fusion is on and
    torch lacks size-oblivious sizes (before 2.13, shared_shape_settings)."""
    return fusion_enabled() and not SHARED_SHAPE_SETTINGS.get("backed_size_oblivious", False)


def graphs_per_function() -> dict[str, int]:
    """Compiled graphs dynamo holds for each hot function that has any (recompiles included): which function a
    compile came from."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    counts = {name: len(_debug_get_cache_entry_list(fn.__code__)) for name, fn in _plain.items()}
    return {name.rsplit(".", 1)[1]: count for name, count in counts.items() if count}


def share_graphs_across_sizes() -> None:
    """One compiled graph per hot function serves every row count: no graph of its own for two dimensions that happen
    to be equal, nor, from torch 2.13 on, for a size of one (dynamo specialises sizes 0 and 1 by default). Compiles are most
    of the time to ready; capture sizes share their graphs (tests/test_fusion.py). Process-wide while fusion is on
    (torch's shape settings are global); disable_fusion restores them."""
    shapes = torch.fx.experimental._config
    for key, value in SHARED_SHAPE_SETTINGS.items():
        if hasattr(shapes, key):  # a torch without the setting compiles as before
            _change(shapes, key, value)


def _change(config: object, key: str, value: object) -> None:
    """Set one of torch's settings, keeping the value it had before enable_fusion for disable_fusion."""
    _saved_settings.setdefault((config, key), getattr(config, key))
    setattr(config, key, value)


def _inductor_options(name: str) -> dict[str, bool]:
    """Generated kernels launch early (kernels/pdl.py) beside our own, except between library calls."""
    if not hasattr(torch._inductor.config.triton, "enable_pdl"):
        return {}
    return {"triton.enable_pdl": inductor_pdl() and name not in _between_library_calls}


def disable_fusion() -> None:
    """Calls go to the plain functions again, and every torch setting enable_fusion changed is as it was before."""
    global _enabled_with
    _fused.clear()
    _enabled_with = None
    for (config, key), value in _saved_settings.items():
        setattr(config, key, value)
    _saved_settings.clear()
