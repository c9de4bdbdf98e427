"""The sampler's k-th largest kernels under the interpreter, one pass and two: torch.topk's value, duplicates counted,
-inf columns, rows with fewer finite values than k. Chunks of 64 columns and rows of at most 256 in one program (the
GPU's 2048 and 4096) keep Bitonic sorts small enough for numpy; the passes are the same."""

from __future__ import annotations

import pytest
import torch

from music3serve.kernels import top_k
from music3serve.kernels.top_k import kth_largest, kth_largest_reference


@pytest.fixture(autouse=True)
def small_programs(monkeypatch):
    """CPU rows take the kernels (each test's rows have candidates that fit one program), in small programs."""
    monkeypatch.setattr(top_k, "CHUNK", 64)
    monkeypatch.setattr(top_k, "MAX_COLUMNS", 256)
    monkeypatch.setattr(top_k, "uses_kernel", lambda x, k: True)


def rows_to_rank(rows: int, columns: int) -> torch.Tensor:
    """Random rows, a row of ties, a row half -inf, and a row with fewer finite values than most k."""
    x = torch.randn(rows, columns) * 4
    x[1] = torch.randint(-3, 3, (columns,)).float()
    x[2, : columns // 2] = float("-inf")
    x[3] = float("-inf")
    x[3, : min(7, columns)] = torch.arange(float(min(7, columns)))
    return x


@pytest.mark.parametrize("columns,ks,passes", [(3, [1, 2, 3], 1), (200, [1, 2, 7, 50, 200], 1), (300, [1, 7, 16], 2)])
def test_the_kernels_give_the_topk_value(columns, ks, passes):
    x = rows_to_rank(4, columns)
    assert (columns > top_k.MAX_COLUMNS) == (passes == 2)
    for k in ks:
        assert torch.equal(kth_largest(x, k), kth_largest_reference(x, k)), k
