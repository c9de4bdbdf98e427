"""Full-size configurations of the released checkpoint, random-weight modules, and GPU timing."""

from __future__ import annotations

import functools
import statistics
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn

from .. import contract
from ..checkpoint_layout import COMPONENTS


# The released checkpoint's config values (its config.json files); weights are random, costs are the same.
FULL_CONFIGS: dict[str, dict[str, Any]] = {
    "language_model": {
        "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "vocab_size": contract.LM_VOCAB_SIZE, "max_position_embeddings": contract.MAX_CONTEXT,
    },
    "depth_decoder": {
        "hidden_size": 4096, "num_layers": 4, "num_attention_heads": 16, "intermediate_size": 6144,
        "audio_vocab_size": 1024, "num_codebooks": 8, "max_position_embeddings": 16,
    },
    "condition_encoder": {
        "condition_hidden_dim": 4096, "num_condition_layers": 8, "out_dim": 2048, "input_sampling_rate": 24000,
        "input_hop_length": 960, "output_sampling_rate": contract.SAMPLE_RATE, "output_hop_length": 512,
    },
    "dit": {
        "in_channels": 128, "condition_dim": 2048, "num_layers": 36, "num_attention_heads": 32,
        "attention_head_dim": 64, "ff_inner_dim": 8192, "rotary_dim": 32, "fourier_embedding_dim": 256,
    },
    "vocoder": {
        "latent_channels": 128, "decoder_input_dim": 1024, "decoder_hidden_dim": 1536,
        "upsampling_ratios": [8, 8, 4, 2], "sampling_rate": contract.SAMPLE_RATE,
    },
}


def full_size(name: str, dtype: torch.dtype, **config: Any) -> nn.Module:
    """Our module for a component at full size (or with the `config` values given instead), on the meta device:
    shapes and dtypes, no memory."""
    component = COMPONENTS[name]
    with torch.device("meta"):
        return component.model(component.config({**FULL_CONFIGS[name], **config})).to(dtype)


@torch.no_grad()
def random_module(name: str, device: str, dtype: torch.dtype, seed: int = 0, **config: Any) -> nn.Module:
    """Our module for a component at full size (or with the `config` values given instead, say fewer layers), filled
    with random weights of realistic scale."""
    module = full_size(name, dtype, **config).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for pname, param in module.named_parameters():
        if "norm" in pname or pname.endswith(("alpha", "scale")):
            param.fill_(1.0)
        elif param.dim() == 1:
            param.zero_()
        else:
            fan_in = param[0].numel() if "embed" not in pname and "positions" not in pname else 50
            param.normal_(0.0, fan_in**-0.5, generator=gen)
    return module.eval().requires_grad_(False)


@functools.cache
def copy_bandwidth() -> float:
    """B/s of a 1 GiB device-to-device copy on the current card, bytes read plus written (H200: 4.29e12, H100:
    about 3.0e12): the floor of every weight read."""
    seconds = _copy_ms(1 << 30) * 1e-3
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / seconds


def _copy_ms(size: int) -> float:
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src))


def time_ms(fn: Callable[[], Any], warmup: int = 3, repeat: int = 20) -> float:
    """Median milliseconds of fn() on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(call_ms(fn) for _ in range(repeat))


def interleaved_ms(fns: dict[str, Callable[[], Any]], rounds: int = 15) -> dict[str, float]:
    """Median milliseconds of each fn over `rounds` rounds that time every fn in turn (5 calls each), so that clock
    drift during the run falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(time_ms(fn, warmup=1, repeat=5))
    return {name: statistics.median(ms) for name, ms in times.items()}


def call_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds of one fn() on the current CUDA stream, between two events (waits for the second)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def graphed(fn: Callable[[], Any], stream: torch.cuda.Stream | None = None) -> Callable[[], None]:
    """fn captured as a CUDA graph (after a warm-up on a side stream, or on `stream` and captured there);
    returns its replay."""
    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay


def param_bytes(module: nn.Module | torch.Tensor) -> int:
    """Bytes of a tensor, or of a module's parameters and buffers (an FP8 layer holds its codes and scales there)."""
    tensors = [module] if isinstance(module, torch.Tensor) else [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (a compile while a song plays stalls it)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class KernelCompiles:
    """Our Triton kernels compiled (or loaded from Triton's cache) in this process, by name, from `watch()` on:
    Triton's post-compile hook sees the kernels launched through triton.jit, ours; inductor's belong to its graphs
    (compiled_graphs). A kernel first compiled while a song plays stalls it as a graph does; a launch that retries with
    fewer stages (kernels/fitting_stages.py) counts each try."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def watch(self) -> None:
        """Count from now on (without Triton: nothing to count)."""
        try:
            from triton import knobs
        except ImportError:
            return
        knobs.runtime.jit_post_compile_hook = self.compiled

    def compiled(self, *, fn: Any, already_compiled: bool = False, **_: Any) -> None:
        if not already_compiled:  # inductor's kernels, where it calls the hook too
            self.names.append(fn.name.rpartition(".")[2])  # the kernel, not the factory it is defined in

    def since(self, start: int, stop: int | None = None) -> dict[str, int]:
        """Compiles per kernel after the first `start` ones (up to the first `stop`)."""
        return dict(Counter(self.names[start:stop]))
