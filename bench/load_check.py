"""What the loader's NaN/inf check costs on the GPU: `checkpoint_checks.all_finite` on every full-size component in the
dtype the loader gives it, and, for scale, the load of the full-size language model (16 GB, zeros written in the
checkpoint layout to a temporary folder, so read from the page cache) with its check included.

Run on a GPU machine: `PYTHONPATH=src python3 bench/load_check.py [folder for the 16 GB checkpoint]`."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from music3serve.bench.common import FULL_CONFIGS, random_module, time_ms
from music3serve.checkpoint import load_component
from music3serve.checkpoint_checks import all_finite
from music3serve.tiny import write_component

# The dtype load_models gives each component on CUDA.
LOAD_DTYPES = {
    "language_model": torch.bfloat16,
    "depth_decoder": torch.bfloat16,
    "condition_encoder": torch.float32,
    "dit": torch.float32,
    "vocoder": torch.float32,
}


def check_cost(name: str, dtype: torch.dtype) -> tuple[str, float]:
    """One component's table row and its check's milliseconds."""
    module = random_module(name, "cuda", dtype)
    params = list(module.parameters())
    size = sum(p.numel() * p.element_size() for p in params)
    assert all_finite(module)
    ms = time_ms(lambda: all_finite(module), warmup=2, repeat=5)
    row = (f"| {name} | {str(dtype).removeprefix('torch.')} | {size / 1e9:.2f} | {len(params)} | {ms:.2f} | "
           f"{size / ms / 1e6:.0f} |")
    return row, ms


def check_costs() -> list[str]:
    rows = ["| component | dtype | GB | parameters | check ms | GB/s |", "|---|---|---|---|---|---|"]
    total_ms = 0.0
    for name, dtype in LOAD_DTYPES.items():
        row, ms = check_cost(name, dtype)
        rows.append(row)
        total_ms += ms
        torch.cuda.empty_cache()
    rows.append(f"| all five | | | | {total_ms:.2f} | |")
    return rows


def language_model_load(folder: Path) -> list[str]:
    start = time.perf_counter()
    write_component(folder, "language_model", FULL_CONFIGS["language_model"],
                    lambda key, shape: torch.zeros(shape, dtype=torch.bfloat16))
    written = time.perf_counter() - start
    load_component(folder, "language_model", "cuda", torch.bfloat16)  # once, so the timed load reads the page cache
    torch.cuda.empty_cache()
    start = time.perf_counter()
    module = load_component(folder, "language_model", "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    loaded = time.perf_counter() - start
    check = time_ms(lambda: all_finite(module), warmup=1, repeat=5)
    return [f"language model, 16 GB in the checkpoint layout: written in {written:.1f} s; loaded to CUDA from the page "
            f"cache in {loaded:.2f} s, of which the check is {check:.1f} ms ({check / 10 / loaded:.2f}%)"]


def main() -> None:
    print("\n".join(check_costs()), flush=True)
    if len(sys.argv) > 1:
        print("\n".join(language_model_load(Path(sys.argv[1]))))
    else:
        with tempfile.TemporaryDirectory() as folder:
            print("\n".join(language_model_load(Path(folder))))


if __name__ == "__main__":
    main()
