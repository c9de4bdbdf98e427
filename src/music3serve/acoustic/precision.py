"""Precision of stage 1: which parts run in bf16, the float32 islands, TF32 off. Measuring the cost against float32
is music3serve.bench.precision's.

A policy casts a component's parameters in place: everything to the stage dtype except the named float32 islands.
Where dtypes meet, every weighted layer casts its input to its own weight dtype (a forward pre-hook; the DiT
blocks' fused functions do the same casts themselves, models/dit.py), so an island computes in float32 on the
upcast input and the next bf16 layer reads a bf16 copy. The DiT's residual stream dtype is set explicitly at each
block's entry (float32 with the "residual" island, else the stage dtype).

The DiT islands' Linear layers (those called as modules: stem, proj_in, the time MLP, proj_out and post; the
blocks' fused functions hold none) multiply per the policy's `dit_island_matmuls`. "ieee": float32 GEMMs (FFMA on
the GPU, ~60 TFLOP/s on an H200). "bf16x3": both factors split into bf16 high and low parts, three bf16 products
summed in float32 on the tensor cores, float32 out (`bf16x3_linear`): at most ~3 * 2^-16 relative error per
product before the float32 sum, against 2^-24 for IEEE and ~2^-10 for TF32's 10-bit inputs. The weights' split
is taken once per policy application, a bf16 buffer [out, 3 in] beside each float32 weight.

TF32 is off for every float32 matmul here. The flags are process-wide and the talker runs in another thread of
the same process (its float32 conditioning mix, and inductor's guards on its compiled hot paths, would see them),
so the only TF32 a policy may ask for is cuDNN's, for the vocoder's convolutions: the talker runs no float32
convolutions, and cuDNN's flag is on by default in PyTorch anyway.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Literal, get_args

import torch
from torch import nn

from ..models.fp8 import quantize_linears

# Parameter-name rules of the islands that may stay float32 while the rest of a component runs in bf16.
DIT_ISLANDS: dict[str, Callable[[str], bool]] = {
    "time": lambda name: name == "fourier" or name.startswith(("time_in.", "time_out.")),  # time embedding MLP
    "norm": lambda name: ".norm1." in name or ".norm2." in name,  # LayerNorm statistics and affine
    "stem": lambda name: name.startswith(("stem.", "proj_in.")),  # [latent, zeros, condition] -> width
    "head": lambda name: name.startswith(("proj_out.", "post.")),  # width -> velocity
    "residual": lambda name: False,  # the residual stream between blocks (no parameters)
}
VOCODER_ISLANDS: dict[str, Callable[[str], bool]] = {
    "snake": lambda name: name.endswith("alpha"),  # sin(alpha x)^2 / alpha in float32
    "in": lambda name: name.startswith(("latent_in.", "conv_in.")),
    "out": lambda name: name.startswith(("snake_out.", "conv_out.")),
}
WEIGHTED = (nn.Linear, nn.Conv1d, nn.ConvTranspose1d, nn.LayerNorm)
IslandMatmuls = Literal["ieee", "bf16x3"]  # how float32 islands' Linear layers multiply (module docstring)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Stage dtypes and the float32 islands of the bf16 ones."""

    name: str = "float32"
    dit: torch.dtype = torch.float32
    dit_float32: frozenset[str] = frozenset()
    vocoder: torch.dtype = torch.float32
    vocoder_float32: frozenset[str] = frozenset()
    vocoder_tf32: bool = False  # a float32 vocoder's convolutions use TF32 (cuDNN; 10-bit mantissa inputs)
    condition_encoder: torch.dtype = torch.float32
    dit_island_matmuls: IslandMatmuls = "ieee"  # the DiT islands' Linear layers: float32 GEMMs, or bf16x3_linear
    dit_fp8: bool = False  # the DiT blocks' linear layers in e4m3, weights and activations (models/fp8.py)

    def __post_init__(self) -> None:
        if self.dit_island_matmuls not in get_args(IslandMatmuls):
            raise ValueError(f"island matmuls must be one of {get_args(IslandMatmuls)}, "
                             f"got {self.dit_island_matmuls!r}")
        for islands, known in ((self.dit_float32, DIT_ISLANDS), (self.vocoder_float32, VOCODER_ISLANDS)):
            unknown = set(islands) - set(known)
            if unknown:
                raise ValueError(f"unknown float32 islands {sorted(unknown)}; known: {sorted(known)}")

    @staticmethod
    def named(name: str) -> "PrecisionPolicy":
        """The policy for a stage `dtype` setting: "float32" (reference) or "bfloat16"; or "fp8" (`quantization`)."""
        try:
            return POLICIES[name]
        except KeyError:
            raise ValueError(f"acoustic dtype must be one of {sorted(POLICIES)}, got {name!r}") from None


FLOAT32 = PrecisionPolicy()
# Chosen from measure_precision (music3serve.bench.precision) on the tiny checkpoint (numbers in
# tests/test_renderer.py); re-measure on the real one.
# A TF32 vocoder: measured at full size (docs/precision.md), its error stays under the one the bf16 DiT puts into
# the waveform, and it runs 2.7x faster than IEEE float32. The islands' Linear layers run as bf16x3: float32-grade
# (~2^-16) on the bf16 tensor cores instead of float32 FFMA.
BFLOAT16 = PrecisionPolicy(
    name="bfloat16",
    dit=torch.bfloat16,
    dit_float32=frozenset({"time", "norm", "stem", "head", "residual"}),
    vocoder=torch.float32,
    vocoder_tf32=True,
    dit_island_matmuls="bf16x3",
)
# bf16 with the blocks' qkv, o, ff_in and ff_out GEMMs in FP8 (weights per channel, activations per token, bf16 out);
# time embedding, norms, stem, head and the residual stream keep their float32 islands, the Euler state and the
# guidance blend stay as in bf16, and the vocoder and condition encoder are untouched.
FP8 = replace(BFLOAT16, name="fp8", dit_fp8=True)
POLICIES = {"float32": FLOAT32, "bfloat16": BFLOAT16, "fp8": FP8}
DIT_FP8_LAYERS = (".qkv", ".o", ".ff_in", ".ff_out")  # the blocks' linear layers FP8 replaces


def _cast_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    x = args[0]
    if torch.is_tensor(x) and x.is_floating_point() and x.dtype != module.weight.dtype:
        return (x.to(module.weight.dtype), *args[1:])
    return args


def bf16_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hi, lo in bf16 with float32 x = hi + lo + e, |e| <= 2^-16 |x|: hi = bf16(x), x - hi is exact in float32
    (Sterbenz), lo = bf16(x - hi)."""
    hi = x.bfloat16()
    return hi, (x.float() - hi.float()).bfloat16()


def split_weight(weight: torch.Tensor) -> torch.Tensor:
    """[W_hi | W_lo | W_hi] in bf16, [out, 3 in]: the weight side of bf16x3_linear, taken once per weight."""
    hi, lo = bf16_split(weight.detach())
    return torch.cat((hi, lo, hi), dim=1)


def bf16x3_linear(x: torch.Tensor, split: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + bias in float32 from bf16 products, `split` = split_weight(W): one GEMM over 3 in columns,
    [x_lo | x_hi | x_hi] @ [W_hi | W_lo | W_hi]^T, the two small corrections summed before x_hi W_hi^T (the tensor
    cores appear to truncate each addition to the running sum: 2.5x less error so on an H200). On CUDA a bf16 GEMM with
    float32 output (aten mm.dtype); on the CPU, which has no mm.dtype, the same bf16 pieces upcast and multiplied
    in float32. The products of bf16 pieces are exact in float32 either way: the two differ in summation alone.
    Runs eagerly in the DiT; compiled by inductor, it needs emulate_precision_casts (models/fusion.py sets it),
    or inductor drops the bf16 rounding of x_hi and x_lo comes out 0."""
    k = x.shape[-1]
    a = torch.empty(*x.shape[:-1], 3 * k, dtype=torch.bfloat16, device=x.device)
    lo, hi = a[..., :k], a[..., k : 2 * k]
    hi.copy_(x)
    a[..., 2 * k :].copy_(hi)
    lo.copy_(x - hi)  # x - hi in float32 (exact), rounded to bf16 on the store
    a = a.view(-1, 3 * k)
    if a.is_cuda:
        y = torch.mm(a, split.T, out_dtype=torch.float32)
    else:
        y = a.float() @ split.float().T
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], split.shape[0])


class Bf16x3Linear(nn.Linear):
    """A float32 Linear that multiplies by bf16x3_linear. It shares the float32 parameters of the layer it replaces;
    their split is taken again after `load_state_dict` and after `.to()` / `.cuda()` (which would otherwise cast
    the bf16 split buffer too). Other in-place changes of the weight need `refresh()`."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("split", split_weight(linear.weight), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, _keys: module.refresh())

    def refresh(self) -> None:
        self.split = split_weight(self.weight)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.refresh()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bf16x3_linear(x, self.split, self.bias)


def _plain_linear(linear: nn.Linear) -> nn.Linear:
    plain = nn.Linear(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
    plain.weight, plain.bias = linear.weight, linear.bias
    return plain


def cast_component(
    module: nn.Module,
    dtype: torch.dtype,
    islands: dict[str, Callable[[str], bool]],
    keep: frozenset[str],
    blocks: nn.ModuleList | None = None,
    island_matmuls: IslandMatmuls = "ieee",
) -> nn.Module:
    """Cast `module`'s parameters in place: float32 where a kept island's rule matches, `dtype` elsewhere.

    Cast down from float32 weights: an island of a module loaded in bf16 only gets the bf16 values back upcast.
    `blocks` (the DiT's) get their input cast to the residual stream dtype when the component is mixed; layers
    inside them get no hooks, as the blocks' fused functions cast each layer's input themselves (models/dit.py).
    With island_matmuls "bf16x3", the float32 Linear layers outside `blocks` of a non-float32 component become
    Bf16x3Linear (the blocks' fused functions read their weights directly); any others are plain nn.Linear again."""
    for handle in getattr(module, "_precision_hooks", []):
        handle.remove()
    rules = [islands[name] for name in keep]
    for name, param in module.named_parameters():
        target = torch.float32 if any(rule(name) for rule in rules) else dtype
        if param.dtype != target:
            param.data = param.data.to(target)
    inside = {id(m) for b in blocks for m in b.modules()} if blocks is not None else set()
    split = island_matmuls == "bf16x3" and dtype != torch.float32
    for name, layer in list(module.named_modules()):
        if not isinstance(layer, nn.Linear) or id(layer) in inside:
            continue
        want = split and layer.weight.dtype == torch.float32
        if want or isinstance(layer, Bf16x3Linear):
            parent, _, attr = name.rpartition(".")
            module.get_submodule(parent).register_module(attr, Bf16x3Linear(layer) if want else _plain_linear(layer))
    hooks = []
    if len({p.dtype for p in module.parameters()}) > 1 or "residual" in keep:
        hooks = [m.register_forward_pre_hook(_cast_input) for m in module.modules()
                 if isinstance(m, WEIGHTED) and id(m) not in inside]
        if blocks is not None:
            stream = torch.float32 if "residual" in keep else dtype
            hooks += [b.register_forward_pre_hook(lambda _m, a: (a[0].to(stream), *a[1:])) for b in blocks]
    module._precision_hooks = hooks
    return module


def apply_dit_policy(dit: nn.Module, policy: PrecisionPolicy) -> None:
    """The DiT in the policy's dtype with its float32 islands (in place); below float32, its feed-forwards' rows in
    the pairs that kernels/glu_linear.py fuses (the float32 reference has the checkpoint's order)."""
    keep = policy.dit_float32 if policy.dit != torch.float32 else frozenset()
    cast_component(dit, policy.dit, DIT_ISLANDS, keep, blocks=dit.blocks, island_matmuls=policy.dit_island_matmuls)
    for block in dit.blocks:
        block.set_glu_pairs(policy.dit != torch.float32)
    if policy.dit_fp8:  # after the pairing: each row's scale moves with it; one-way (the bf16 weights are dropped)
        quantize_linears(dit.blocks, lambda name: name.endswith(DIT_FP8_LAYERS))


def apply_policy(encoder: nn.Module, dit: nn.Module, vocoder: nn.Module, policy: PrecisionPolicy) -> None:
    """Put the three acoustic components in the policy's dtypes (in place)."""
    cast_component(encoder, policy.condition_encoder, {}, frozenset())
    apply_dit_policy(dit, policy)
    keep = policy.vocoder_float32 if policy.vocoder != torch.float32 else frozenset()
    cast_component(vocoder, policy.vocoder, VOCODER_ISLANDS, keep)


@contextlib.contextmanager
def float32_matmuls(device: torch.device | str, conv_tf32: bool = False) -> Iterator[None]:
    """IEEE float32 matmuls on CUDA while inside, convolutions too unless `conv_tf32`; the previous flags come back
    after. The flags are process-wide: another thread's float32 CUDA work at the same time sees them."""
    if torch.device(device).type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, conv_tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
