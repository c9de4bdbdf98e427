"""Where the GPU time goes (full-size random weights): kernel tables of the talker frame step
(graph replay, 1 and 8 songs), the DiT call of the bf16 and FP8 policies (plain and fused), and the vocoder per
precision with its SNR against IEEE float32. The talker's matmuls against copy bandwidth: bench/skinny_linear.py.

    PYTHONPATH=src python3 bench/profile_gpu.py [talker|talker-fp8|dit|dit-fp8|vocoder ...]

Kernels run without programmatic dependent launch here (MUSIC3SERVE_PDL=off unless set): under it a kernel that
starts early counts its wait for the previous one as running time, and the tables stop adding up.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from music3serve.acoustic.precision import BFLOAT16, FP8, PrecisionPolicy, apply_dit_policy, float32_matmuls
from music3serve.bench.acoustic import PEAK_TFLOPS, dit_flops
from music3serve.bench.common import graphed, random_module, time_ms
from music3serve.bench.precision import snr_db
from music3serve.bench.talker import admit
from music3serve.models.fusion import disable_fusion, enable_fusion
from music3serve.talker.config import TalkerConfig
from music3serve.talker.engine import Talker
from music3serve.talker.quantize import quantize_talker

os.environ.setdefault("MUSIC3SERVE_PDL", "off")
TALKER_ROWS = int(os.environ.get("PROFILE_TALKER_ROWS", "25"))  # kernels listed per talker table


def kernel_table(fn, label: str, calls: int = 10, rows: int = 25) -> None:
    """The kernels fn launches, by device time per call, largest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / calls
    launches = sum(e.count for e in events) // calls
    print(f"\n### {label}: {total / 1e3:.2f} ms of kernels, {launches} launches per call")
    for e in events[:rows]:
        print(f"{e.self_device_time_total / calls:9.1f} us {e.count // calls:5d}x  {e.key[:120]}")


@torch.inference_mode()
def talker(fp8: bool = False) -> None:
    lm = random_module("language_model", "cuda", torch.bfloat16)
    depth = random_module("depth_decoder", "cuda", torch.bfloat16, seed=1)
    if fp8:
        quantize_talker(lm, depth)
    encoder = random_module("condition_encoder", "cuda", torch.float32, seed=2)
    engine = Talker(lm, depth, encoder, TalkerConfig(max_num_seqs=16, capture_sizes=(2, 16)))
    for songs in (1, 8):
        admit(engine, songs, 300)
        print(f"\ntalker step, {songs} songs: {time_ms(lambda: engine.step_fn(2 * songs), repeat=50):.2f} ms (graph)")
        kernel_table(lambda: engine.step_fn(2 * songs), f"talker frame step{' (fp8)' if fp8 else ''}, {songs} song(s), graph replay",
                     rows=TALKER_ROWS)
        for song in list(engine.songs):
            engine.cancel(song)
    disable_fusion()


DIT_POLICIES = {"dit": [("bf16 policy", BFLOAT16), ("bf16, no islands", replace(BFLOAT16, dit_float32=frozenset()))],
                "dit-fp8": [("fp8 policy", FP8)]}


@torch.inference_mode()
def dit(policies: list[tuple[str, PrecisionPolicy]]) -> None:
    length = 689
    for label, policy in policies:
        model = random_module("dit", "cuda", torch.float32)  # a fresh one per policy: FP8 quantizes it one way
        apply_dit_policy(model, policy)
        islands = policy.dit_float32
        for windows in (1, 8):
            x = torch.randn(2 * windows, 128, length, device="cuda", dtype=torch.bfloat16)  # as the renderer passes
            cond = torch.randn(2 * windows, length, 2048, device="cuda", dtype=torch.bfloat16)
            t = torch.full((2 * windows,), 0.5, device="cuda")
            call = lambda: model(x, t, cond)  # noqa: E731
            with float32_matmuls("cuda"):
                disable_fusion()
                plain = time_ms(graphed(call))
                enable_fusion()
                started = time.perf_counter()
                call()
                compiled_s = time.perf_counter() - started
                fused = time_ms(graphed(call))
                tflops = dit_flops(windows) / fused / 1e9
                print(f"\nDiT {label}, {windows} window(s): plain {plain:.2f} ms, fused {fused:.2f} ms "
                      f"({tflops:.0f} TFLOP/s, {tflops / PEAK_TFLOPS:.0%} of the bf16 peak; first fused call "
                      f"{compiled_s:.1f} s)")
                if islands:  # one window: the 13 ms target; eight: the 70%-of-peak one
                    kernel_table(graphed(call), f"DiT {label}, {windows} window(s), fused, graph", calls=3)
    disable_fusion()


@torch.inference_mode()
def vocoder() -> None:
    latents = torch.randn(8, 128, 689, device="cuda")
    model = random_module("vocoder", "cuda", torch.float32)
    with float32_matmuls("cuda"):
        ieee_ms, reference = time_ms(lambda: model(latents)), model(latents)
    with float32_matmuls("cuda", conv_tf32=True):
        tf32_ms, tf32 = time_ms(lambda: model(latents)), model(latents)
    low = model.to(torch.bfloat16)
    bf16_ms, bf16 = time_ms(lambda: low(latents.bfloat16())), low(latents.bfloat16()).float()
    print(f"\nvocoder, 8 windows: float32 {ieee_ms:.1f} ms, TF32 {tf32_ms:.1f} ms (SNR {snr_db(reference, tf32):.1f} dB), "
          f"bf16 {bf16_ms:.1f} ms (SNR {snr_db(reference, bf16):.1f} dB)")
    kernel_table(lambda: model(latents.bfloat16()), "vocoder bf16, 8 windows", calls=3, rows=12)


if __name__ == "__main__":
    parts = {"talker": talker, "talker-fp8": lambda: talker(fp8=True), "vocoder": vocoder,
             **{name: (lambda policies=policies: dit(policies)) for name, policies in DIT_POLICIES.items()}}
    for name in sys.argv[1:] or list(parts):
        parts[name]()
        torch.cuda.empty_cache()
