"""Does the DiT's feed-forward gain from running in row chunks whose [rows, 16384] ff_in output stays in L2?
At eight windows (11040 rows) the SiLU-gate pass between ff_in and ff_out moves ~0.54 GB per block through HBM
(~4.4 ms per call, docs/performance.md); in chunks of a few hundred rows its input and output could be L2 hits,
at the price of smaller GEMMs. Times the feed-forward (ff_in with bias, value * silu(gate), ff_out with bias;
inductor-compiled as the DiT's hot path is) per call in a CUDA graph, weights cycling through 36 blocks' copies,
unchunked and per chunk size, and each chunking's largest difference from the unchunked result.

    PYTHONPATH=src python3 bench/dit_ff_chunks.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from music3serve.bench.common import graphed, table, time_ms

WIDTH, FF, BLOCKS = 2048, 8192, 36
CHUNKS = (None, 256, 512, 768, 1024, 1380, 2048, 2760)


def feed_forward(h, w_in, b_in, w_out, b_out):
    value, gate = F.linear(h, w_in, b_in).chunk(2, dim=-1)
    return F.linear(value * F.silu(gate), w_out, b_out)


@torch.inference_mode()
def main() -> None:
    torch.manual_seed(0)
    compiled = torch.compile(feed_forward, dynamic=True, fullgraph=True)
    weights = [
        (torch.randn(2 * FF, WIDTH, device="cuda", dtype=torch.bfloat16) * WIDTH**-0.5,
         torch.randn(2 * FF, device="cuda", dtype=torch.bfloat16) * 0.02,
         torch.randn(WIDTH, FF, device="cuda", dtype=torch.bfloat16) * FF**-0.5,
         torch.randn(WIDTH, device="cuda", dtype=torch.bfloat16) * 0.02)
        for _ in range(BLOCKS)
    ]
    rows_out = []
    for windows in (1, 8):
        rows = 2 * windows * 690
        h = torch.randn(rows, WIDTH, device="cuda", dtype=torch.bfloat16)
        flop = BLOCKS * 2 * rows * (WIDTH * 2 * FF + FF * WIDTH)
        reference = compiled(h, *weights[0]).float()
        base_ms = None
        for chunk in CHUNKS:
            if chunk is not None and chunk >= rows:
                continue
            size = chunk or rows

            def run(w):  # chunk outputs left apart: joining them would cost a copy the engine would not make
                return [compiled(part, *w) for part in h.split(size)]

            err = ((torch.cat(run(weights[0])).float() - reference).abs().max() / reference.abs().max()).item()
            ms = time_ms(graphed(lambda: [run(w) for w in weights]))
            base_ms = base_ms or ms
            rows_out.append([windows, rows, chunk or "none", ms, flop / ms / 1e9, base_ms - ms, f"{err:.1e}"])
    print(table(["windows", "rows", "chunk rows", "36 blocks ms", "TFLOP/s", "saved ms", "rel diff"], rows_out))


if __name__ == "__main__":
    main()
