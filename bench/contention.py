"""How much the colocated stages slow each other, and whether keeping SMs away from the DiT helps (one H200).

A 20 s song takes 5.8 s end to end while its talker alone needs ~4.5 s (measured 2026-11-30): the DiT
renders on the same GPU and the talker's small kernels wait for SMs. This script times the talker's frame step
(one song, graph replay) and the DiT call (one window, bf16 policy) alone and side by side, the DiT looping on
its own stream in a second thread, for each way of holding SMs back from the DiT that this torch offers:

- cuBLAS SM carveout (`torch._C._set_sm_carveout_experimental`): the DiT's GEMMs leave N SMs free; the talker's
  decode GEMMs are our Triton kernels, which the setting does not touch;
- a green context of N SMs for the DiT's stream (`torch.cuda.green_contexts`), where this torch has one.

    PYTHONPATH=src python3 bench/contention.py
"""

from __future__ import annotations

import threading
import time

import torch

from music3serve.acoustic.precision import BFLOAT16, apply_dit_policy, float32_matmuls
from music3serve.bench.common import graphed, random_module, table, time_ms
from music3serve.bench.talker import admit
from music3serve.models.fusion import enable_fusion
from music3serve.talker.config import TalkerConfig
from music3serve.talker.engine import Talker

STEPS = 200  # talker steps per measurement


def dit_call():
    """One window's cond + uncond DiT call under the bf16 policy, fused."""
    dit = random_module("dit", "cuda", torch.float32)
    apply_dit_policy(dit, BFLOAT16)
    x = torch.randn(2, 128, 689, device="cuda", dtype=torch.bfloat16)
    cond = torch.randn(2, 689, 2048, device="cuda", dtype=torch.bfloat16)
    t = torch.full((2,), 0.5, device="cuda")
    return lambda: dit(x, t, cond)


def captured_on(call, stream: torch.cuda.Stream):
    """call captured as a CUDA graph on `stream`: kernels are chosen now, under the settings in force (a cuBLAS
    carveout), and replays run on `stream`'s SMs."""
    with float32_matmuls("cuda"):
        return graphed(call, stream)


def side_by_side(step, replay, stream: torch.cuda.Stream) -> tuple[float, float]:
    """Talker ms per step (on the talker's stream) while the DiT's graph loops on `stream` in another thread, and
    the DiT's ms per call meanwhile."""
    stop, calls = threading.Event(), [0]

    def loop() -> None:
        with torch.cuda.stream(stream):
            while not stop.is_set():
                replay()
                stream.synchronize()
                calls[0] += 1

    worker = threading.Thread(target=loop)
    worker.start()
    time.sleep(0.5)  # the DiT is running before the talker starts
    started, first = time.perf_counter(), calls[0]
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    elapsed, done = time.perf_counter() - started, calls[0] - first
    stop.set()
    worker.join()
    return elapsed / STEPS * 1e3, elapsed / max(done, 1) * 1e3


_contexts: list = []  # green contexts live as long as their streams: a collected context is destroyed


def green_stream(sms: int) -> torch.cuda.Stream | None:
    """A stream whose kernels run on `sms` SMs, or None where this torch has no green contexts."""
    try:
        from torch.cuda.green_contexts import GreenContext

        context = GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
    except Exception as exc:  # absent, or an older signature: report and go on
        print(f"green context of {sms} SMs: not available ({type(exc).__name__}: {exc})")
        return None
    _contexts.append(context)
    if hasattr(context, "Stream"):
        return context.Stream()
    context.set_context()  # torch 2.10's API: streams made while the context is current belong to it
    try:
        return torch.cuda.Stream()
    finally:
        context.pop_context()


@torch.inference_mode()
def main() -> None:
    enable_fusion()
    lm = random_module("language_model", "cuda", torch.bfloat16)
    depth = random_module("depth_decoder", "cuda", torch.bfloat16, seed=1)
    encoder = random_module("condition_encoder", "cuda", torch.float32, seed=2)
    talker = Talker(lm, depth, encoder, TalkerConfig(max_num_seqs=2, capture_sizes=(2,)))
    admit(talker, 1, 300)

    def step() -> None:
        with torch.cuda.stream(talker.stream):  # high priority, as in the engine
            talker.step_fn(2)

    call, side = dit_call(), torch.cuda.Stream()
    replay = captured_on(call, side)
    with torch.cuda.stream(side):
        dit_alone = time_ms(replay)
    with torch.cuda.stream(talker.stream):
        talker_alone = time_ms(lambda: talker.step_fn(2), repeat=STEPS)
    rows = [["talker alone", talker_alone, "-"], ["DiT alone", "-", dit_alone]]
    rows.append(["side by side", *side_by_side(step, replay, side)])
    for carveout in (8, 16, 32):
        torch._C._set_sm_carveout_experimental(carveout)
        rows.append([f"cuBLAS carveout {carveout} SMs", *side_by_side(step, captured_on(call, side), side)])
    torch._C._set_sm_carveout_experimental(None)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for dit_sms in (sms - 16, sms - 32, sms - 48, sms // 2):
        stream = green_stream(dit_sms)
        if stream is None:
            continue
        try:
            timed = side_by_side(step, captured_on(call, stream), stream)
        except RuntimeError as exc:  # a graph captured on a green context's stream is new ground: report and go on
            print(f"green context of {dit_sms} SMs: failed ({exc})")
            continue
        rows.append([f"DiT in a green context of {dit_sms} SMs", *timed])
    print(table(["setting", "talker ms per step", "DiT ms per call"], rows))


if __name__ == "__main__":
    main()
