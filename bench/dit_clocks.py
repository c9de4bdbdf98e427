"""SM clock and power while the eight-window DiT call runs back to back, beside a plain bf16 matmul loop: is the
call's share of the 791 TFLOP/s peak (measured in short bursts) bound by the clock the card holds under sustained
tensor-core load?

`nvidia-smi` samples clocks, power and the active clock-event reasons every 100 ms in the background while each phase
runs for a few seconds; the table gives each phase's median throughput and what the card did meanwhile. It reads the
card's state and changes nothing.

    PYTHONPATH=src python3 bench/dit_clocks.py
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from typing import Callable

import torch

from music3serve.acoustic.precision import float32_matmuls
from music3serve.bench.acoustic import PEAK_TFLOPS, dit_call, dit_flops, fused_bf16_dit
from music3serve.bench.common import call_ms, graphed, table

PHASE_S = 6.0


def fields() -> str:
    """The query fields this driver's nvidia-smi knows (the clock-event reasons were renamed from throttle reasons)."""
    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        query = f"clocks.sm,power.draw,temperature.gpu,{reasons}"
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True)
        if probe.returncode == 0:
            return query
    return "clocks.sm,power.draw,temperature.gpu,pstate"


def sampler() -> subprocess.Popen:
    """nvidia-smi printing one CSV line of the fields every 100 ms until stopped."""
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={fields()}", "--format=csv,noheader,nounits", "-lms", "100"],
                            stdout=subprocess.PIPE, text=True)


def run_phase(name: str, fn: Callable[[], None], flops: float, samples: list[tuple[float, str]]) -> list:
    """fn back to back for PHASE_S seconds, timed per call; the table row with the samples taken meanwhile."""
    fn()
    torch.cuda.synchronize()
    start, times = time.monotonic(), []
    while time.monotonic() - start < PHASE_S:
        times.append(call_ms(fn))
    stop = time.monotonic()
    during = [line.split(", ") for t, line in samples if start + 1.0 <= t <= stop]  # after a second of load
    during = [f for f in during if len(f) == 4]
    clock = statistics.median([number(f[0]) for f in during] or [float("nan")])
    power = statistics.median([number(f[1]) for f in during] or [float("nan")])
    reasons = sorted({f[3] for f in during})
    ms = statistics.median(times)
    late = statistics.median(times[len(times) // 2 :])
    tflops = flops / ms / 1e9
    return [name, len(times), ms, late, tflops, tflops / PEAK_TFLOPS, clock, power, " ".join(reasons)]


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:  # "[N/A]" and the like
        return float("nan")


@torch.inference_mode()
def main() -> None:
    samples: list[tuple[float, str]] = []
    proc = sampler()
    threading.Thread(target=lambda: [samples.append((time.monotonic(), line.strip())) for line in proc.stdout],
                     daemon=True).start()
    rows = []
    try:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        rows.append(run_phase("idle (sleep 50 ms)", lambda: time.sleep(0.05), 0.0, samples))
        rows.append(run_phase("bf16 matmul 8192^3", lambda: a @ b, 2 * 8192**3, samples))
        dit = fused_bf16_dit()
        with float32_matmuls("cuda"):
            for windows in (8, 1, 8):
                call = dit_call(dit, windows, "cuda", torch.bfloat16)
                rows.append(run_phase(f"DiT call, {windows} windows (graph)", graphed(call), dit_flops(windows),
                                      samples))
                print(table(HEADERS, rows[-1:]), flush=True)
        rows.append(run_phase("bf16 matmul 8192^3 again", lambda: a @ b, 2 * 8192**3, samples))
    finally:
        proc.terminate()
    print(table(HEADERS, rows))


HEADERS = ["phase", "calls", "median ms", "median ms, 2nd half", "TFLOP/s", "x 791 peak", "SM MHz", "power W",
           "clock-event reasons"]


if __name__ == "__main__":
    main()
