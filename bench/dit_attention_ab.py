"""The fused bf16 DiT call (graph) with its attention as our Triton kernel against torch's SDPA, interleaved in one
process so that clock drift between runs cancels: both graphs are captured on the same weights and inputs, then
replayed in alternating rounds; the median per call of each over all rounds.

    PYTHONPATH=src python3 bench/dit_attention_ab.py
"""

from __future__ import annotations

import torch

from music3serve.acoustic.precision import float32_matmuls
from music3serve.bench.acoustic import PEAK_TFLOPS, dit_call, dit_flops, fused_bf16_dit
from music3serve.bench.common import graphed, interleaved_ms, table
from music3serve.kernels import dit_attention as attention
from music3serve.models import dit as dit_module


@torch.inference_mode()
def main() -> None:
    dit, rows = fused_bf16_dit(), []
    variants = {"triton kernel": attention.dit_attention, "sdpa": attention.dit_attention_reference}
    with float32_matmuls("cuda"):
        for windows in (1, 8):
            call = dit_call(dit, windows, "cuda", torch.bfloat16)
            replays, outputs = {}, {}
            for name, fn in variants.items():
                dit_module.dit_attention = fn
                outputs[name] = call().float()
                replays[name] = graphed(call)
            dit_module.dit_attention = attention.dit_attention
            rel = ((outputs["triton kernel"] - outputs["sdpa"]).norm() / outputs["sdpa"].norm()).item()
            for name, ms in interleaved_ms(replays).items():
                rows.append([name, windows, ms, dit_flops(windows) / ms / 1e9 / PEAK_TFLOPS, f"{rel:.1e}"])
                print(table(["attention", "windows", "graph ms", "x peak", "rel diff of outputs"], rows[-1:]),
                      flush=True)
    print(table(["attention", "windows", "graph ms", "x peak", "rel diff of outputs"], rows))


if __name__ == "__main__":
    main()
