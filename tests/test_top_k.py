"""The sampler's threshold kernel: the k-th largest value of each row, the same value `torch.topk` gives
(duplicates counted, -inf columns, one to sixteen rows of the talker's widths), in eager, compiled and graph calls."""

from __future__ import annotations

import pytest
import torch

from music3serve.kernels.top_k import kth_largest, kth_largest_reference
from music3serve.talker.sampling import keep_top_k


def rows_to_rank(rows: int, columns: int, device: str) -> torch.Tensor:
    """Random rows, plus rows full of ties, half -inf, and fewer finite values than k."""
    gen = torch.Generator().manual_seed(rows * 7 + columns)
    x = torch.randn(rows, columns, generator=gen) * 4
    x[1 % rows] = torch.randint(-3, 3, (columns,), generator=gen).float()
    x[2 % rows, : columns // 2] = float("-inf")
    if rows > 3:
        x[3] = float("-inf")
        x[3, : min(7, columns)] = torch.arange(float(min(7, columns)))
    return x.to(device)


def test_rows_whose_candidates_would_not_fit_one_program_take_torch_topk():
    """Two passes keep next_power_of_2(k) values per chunk; when those are more than one program holds, the rows
    go to torch.topk (here: on the CPU, the fallback the CUDA path would take)."""
    from music3serve.kernels import top_k

    assert -(-16385 // top_k.CHUNK) * top_k._keep(50) <= top_k.MAX_COLUMNS  # the semantic draws: two passes
    assert -(-16385 // top_k.CHUNK) * top_k._keep(1000) > top_k.MAX_COLUMNS
    x = rows_to_rank(2, 16385, "cpu")
    assert torch.equal(kth_largest(x, 1000), kth_largest_reference(x, 1000))


def test_cpu_is_torch_topk_and_bad_k_is_refused():
    x = rows_to_rank(4, 1024, "cpu")
    assert torch.equal(kth_largest(x, 50), torch.topk(x, 50, dim=-1).values[:, -1:])
    with pytest.raises(ValueError, match="1 <= k <= columns"):
        kth_largest(x, 1025)
    with pytest.raises(ValueError, match="rows, columns"):
        kth_largest(x[0], 5)


@pytest.mark.gpu
@pytest.mark.parametrize("columns", [1024, 4096, 3, 4097, 16385])  # wider than 4096: two passes
@pytest.mark.parametrize("rows", [1, 2, 16])
def test_kernel_gives_the_topk_value(rows, columns):
    x = rows_to_rank(rows, columns, "cuda")
    for k in sorted({1, 2, min(7, columns), min(50, columns), columns}):
        assert torch.equal(kth_largest(x, k), kth_largest_reference(x, k)), k


@pytest.mark.gpu
def test_compiled_and_graphed_callers_get_the_eager_bits():
    x = rows_to_rank(8, 1024, "cuda")  # the depth decoder's width: the kernel, not the torch.topk fallback
    eager = keep_top_k(x, 50)
    compiled = torch.compile(keep_top_k, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x, 50), eager)
    graph, static = torch.cuda.CUDAGraph(), x.clone()
    keep_top_k(static, 50)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = keep_top_k(static, 50)
    static.copy_(rows_to_rank(8, 1024, "cuda").flip(-1))
    graph.replay()
    assert torch.equal(out, keep_top_k(static, 50))
