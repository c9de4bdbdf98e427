"""The vocoder per window as the renderer runs it (float32 weights, TF32 convolutions), full size, random weights:
eager Snake activations (six kernels each over the window's largest tensors) against the fused one-pass Snake, and
the fused one with cuDNN's autotuner (`torch.backends.cudnn.benchmark`). The SNR of each output against the eager
one says they agree (a float32 rounding difference, not a different result).

    PYTHONPATH=src python3 bench/vocoder.py
"""

from __future__ import annotations

import torch

from music3serve import contract
from music3serve.acoustic.precision import float32_matmuls
from music3serve.bench.common import random_module, table, time_ms
from music3serve.bench.precision import snr_db
from music3serve.models.fusion import disable_fusion, enable_fusion


@torch.inference_mode()
def main() -> None:
    model = random_module("vocoder", "cuda", torch.float32)
    length, rows = contract.latent_length(contract.WINDOW_FRAMES), []
    for windows in (1, 8):
        gen = torch.Generator(device="cuda").manual_seed(windows)
        latents = torch.randn(windows, 128, length, device="cuda", generator=gen)
        call = lambda: model(latents)  # noqa: E731
        with float32_matmuls("cuda", conv_tf32=True):
            disable_fusion()
            eager, eager_ms = call(), time_ms(call)
            enable_fusion()
            fused, fused_ms = call(), time_ms(call)
            torch.backends.cudnn.benchmark = True
            tuned, tuned_ms = call(), time_ms(call)
            torch.backends.cudnn.benchmark = False
        rows.append([windows, eager_ms / windows, fused_ms / windows, tuned_ms / windows,
                     snr_db(eager, fused), snr_db(eager, tuned)])
        print(table(["windows", "eager ms/window", "fused ms/window", "fused + cudnn.benchmark ms/window",
                     "fused SNR dB", "benchmark SNR dB"], rows[-1:]), flush=True)
    disable_fusion()


if __name__ == "__main__":
    main()
