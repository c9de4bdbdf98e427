"""The skinny decode GEMM kernel under the interpreter: bf16 and e4m3 weights (per-channel scales), the gated SiLU
half, the residual (per row, broadcast), strided rows, masked column and K tails, and a row's bits independent of
the rows beside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from music3serve.kernels.skinny_linear import gated_silu_reference, tile_config
from music3serve.kernels import skinny_linear_kernel as skinny_kernel
from music3serve.kernels.skinny_linear_kernel import ROW_TILE, run_kernel
from music3serve.models.fp8 import Fp8Weight, quantize, weight_only_reference

# Neither a multiple of the column tile (16) nor of the K tile (128 bf16, 256 e4m3): both tails are masked.
N, K = 100, 200
STEP = 2.0**-7  # one bf16 step, relative to the value


def weight(n: int = N, fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A bf16 weight [n, K], or its e4m3 codes and float32 scales."""
    w = (torch.randn(n, K) * K**-0.5).to(torch.bfloat16)
    if not fp8:
        return w, None
    q = quantize(w)
    return q.codes, q.scale


def linear(x, w, scale, **options):
    """The kernel on the op's tile for this weight."""
    return run_kernel(x, w, tile_config(w.shape[0], K, options.get("gated", False), scale is not None), scale=scale,
                      **options)


def within_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernel and the torch ops add the same float32 products in another order and round each intermediate to
    bf16, so a value may land one bf16 step away (tests/test_fp8_gpu.py measured such steps on the H200): at most two
    steps of the largest value, one step of the norm. A wrong mask, index or scale is off by O(1)."""
    diff, largest = (got.float() - want.float()).abs(), want.float().abs().max()
    assert diff.max() <= 2 * STEP * largest, (diff.max(), largest)
    assert diff.norm() <= STEP * want.float().norm(), (diff.norm(), want.float().norm())


def product(x, w, scale):
    """The torch ops' x @ w.T: F.linear, or the e4m3 weight's reference product."""
    return F.linear(x, w) if scale is None else weight_only_reference(x, Fp8Weight(w, scale))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("rows", [1, 2, 5, ROW_TILE, 2 * ROW_TILE + 3])  # the last: tiles of 32 rows, one partial
def test_the_product_is_the_torch_ops_within_rounding(rows, fp8):
    w, scale = weight(fp8=fp8)
    x = torch.randn(rows, K).to(torch.bfloat16)
    got = linear(x, w, scale)
    assert got.shape == (rows, N) and got.dtype == torch.bfloat16
    within_rounding(got, product(x, w, scale))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("rows", [1, 5])
def test_the_gated_half_is_the_torch_ops_within_rounding(rows, fp8):
    gate_up, scale = weight(2 * N, fp8=fp8)
    x = torch.randn(rows, K).to(torch.bfloat16)
    got = linear(x, gate_up, scale, gated=True)
    assert got.shape == (rows, N)
    within_rounding(got, gated_silu_reference(x, gate_up, scale))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_the_residual_is_added_to_the_rounded_product_as_the_torch_add_does(fp8):
    w, scale = weight(fp8=fp8)
    x = torch.randn(3, K).to(torch.bfloat16)
    residual = (torch.randn(3, N) * 4).to(torch.bfloat16)
    alone = linear(x, w, scale)
    assert torch.equal(linear(x, w, scale, residual=residual), residual + alone)
    row = residual[1]
    assert torch.equal(linear(x, w, scale, residual=row.expand(3, N)), row + alone)  # stride 0: one row for all


def test_rows_sliced_from_a_longer_sequence_give_the_bits_of_their_copy():
    w, _ = weight()
    last = torch.randn(3, 2, K).to(torch.bfloat16)[:, -1]
    assert not last.is_contiguous()
    assert torch.equal(linear(last, w, None), linear(last.contiguous(), w, None))


@pytest.mark.parametrize("gated", [False, True])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(gated):
    w, _ = weight(2 * N if gated else N)
    x = torch.randn(ROW_TILE, K).to(torch.bfloat16)
    full = linear(x, w, None, gated=gated)
    for rows in (1, 2, 7):
        assert torch.equal(linear(x[:rows].clone(), w, None, gated=gated), full[:rows])
    assert torch.equal(linear(x.flip(0).contiguous(), w, None, gated=gated), full.flip(0))


def every_code(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes [n, K] holding every finite code (zeros and subnormals of both signs included), and scales."""
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = finite[torch.randperm(n * K) % len(finite)].view(n, K).view(torch.float8_e4m3fn)
    return codes, (torch.rand(n) + 0.5) / 256  # results of a few units: no overflow in silu


@pytest.mark.parametrize("rows", [1, 2, 7, ROW_TILE, 2 * ROW_TILE + 3])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("k_tiles", ["one", "four"])
def test_the_bits_widening_gives_the_bits_of_the_cast_in_either_split_of_k(rows, gated, k_tiles):
    """bits = bits-mul = cvt and bits-kwarps = cvt-kwarps bit for bit, in one K tile or over several (words from
    each tile's own offset); K over the warps within the bound of the exact product."""
    w, scale = every_code(2 * N if gated else N)
    x = torch.randn(rows, K).to(torch.bfloat16)
    tile = tile_config(w.shape[0], K, gated, fp8=True)[:4] if k_tiles == "one" else (16, 64, 4, 2)
    assert K % tile[1] and -(-K // tile[1]) == {"one": 1, "four": 4}[k_tiles]  # and a masked K tail of words
    want = gated_silu_reference(x, w, scale) if gated else product(x, w, scale)
    for widening, split in (("bits", ""), ("bits-mul", ""), ("bits", "-kwarps")):
        got = run_kernel(x, w, (*tile, widening + split), gated=gated, scale=scale)
        assert torch.equal(got, run_kernel(x, w, (*tile, "cvt" + split), gated=gated, scale=scale))
        within_rounding(got, want)


def test_a_weight_view_off_int32_alignment_takes_the_cast():
    """Rows that are not whole aligned int32 words (a view at an odd offset, a row stride or width not a multiple of
    4) are widened by the cast, with its bits."""
    w, scale = every_code(N)
    wide = torch.cat([w.view(torch.uint8), w.view(torch.uint8)], dim=1).view(torch.float8_e4m3fn)  # [N, 2 K]
    padded = torch.cat([w.view(torch.uint8), w.view(torch.uint8)[:, :2]], dim=1).view(torch.float8_e4m3fn)
    views = {"odd offset": wide.view(-1)[1 : 1 + N * K].view(N, K), "row stride": padded[:, :K],
             "width": w[:, : K - 2]}
    for name, view in views.items():
        assert skinny_kernel._variant(view, scale, "bits")[0] == 0, name
        x = torch.randn(3, view.shape[1]).to(torch.bfloat16)
        tile = (*tile_config(N, view.shape[1], fp8=True)[:4], "bits")
        assert torch.equal(run_kernel(x, view, tile, scale=scale), run_kernel(x, view, tile[:4], scale=scale)), name
    assert skinny_kernel._variant(wide[:, K : 2 * K], scale, "bits")[0] == 1  # aligned: the bits widening


@pytest.mark.parametrize("variant", ["bits", "bits-kwarps"])
def test_the_variants_add_the_residual_and_keep_a_rows_bits_whatever_the_rows_beside_it(variant):
    w, scale = every_code(N)
    rows = 2 * ROW_TILE + 3  # two tiles of 32 rows, the second partial
    x, residual = torch.randn(rows, K).to(torch.bfloat16), (torch.randn(rows, N) * 4).to(torch.bfloat16)
    tile = (*tile_config(N, K, fp8=True)[:4], variant)
    full = run_kernel(x, w, tile, scale=scale)
    for rows in (1, 2, 7):
        assert torch.equal(run_kernel(x[:rows].clone(), w, tile, scale=scale), full[:rows])
    assert torch.equal(run_kernel(x, w, tile, residual=residual, scale=scale), residual + full)


def test_rows_that_are_not_whole_words_take_the_cast_and_bad_variants_are_refused():
    w, scale = every_code(N)
    tile = (*tile_config(N, K, fp8=True)[:4], "bits")
    x = torch.randn(2, K - 2).to(torch.bfloat16)
    assert torch.equal(run_kernel(x, w[:, 2:], tile, scale=scale), run_kernel(x, w[:, 2:].contiguous(), tile[:4],
                                                                             scale=scale))
    with pytest.raises(ValueError, match="e4m3 weights"):
        run_kernel(torch.randn(2, K).to(torch.bfloat16), weight()[0], tile)
    with pytest.raises(ValueError, match="not one of"):
        run_kernel(torch.randn(2, K).to(torch.bfloat16), w, (*tile[:4], "f16"), scale=scale)
    with pytest.raises(ValueError, match="BLOCK_K a multiple of 64"):
        run_kernel(torch.randn(2, K).to(torch.bfloat16), w, (16, 32, 4, 2, "bits-kwarps"), scale=scale)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_k_over_the_warps_of_a_bf16_tile_is_within_the_bound_and_a_rows_bits_stay(gated):
    """bench/skinny_linear.py --sweep --kwarps tries bf16 tiles with K over their warps: the same bound against the
    torch ops, a row's bits whatever the rows beside it."""
    w, _ = weight(2 * N if gated else N)
    x = torch.randn(2 * ROW_TILE + 3, K).to(torch.bfloat16)
    tile = (16, 64, 4, 2, "cvt-kwarps")
    full = run_kernel(x, w, tile, gated=gated)
    within_rounding(full, gated_silu_reference(x, w) if gated else product(x, w, None))
    for rows in (1, 2, 7):
        assert torch.equal(run_kernel(x[:rows].clone(), w, tile, gated=gated), full[:rows])


def test_a_tile_past_shared_memory_launches_with_the_most_stages_that_fit_and_remembers_them():
    from triton.runtime.errors import OutOfResources

    from music3serve.kernels import fitting_stages

    tried = []

    def launch(num_stages):
        tried.append(num_stages)
        if num_stages > 2:
            raise OutOfResources(num_stages * 98304, 232448, "shared memory")

    key = ("a test tile",)
    fitting_stages.launch_fitting(launch, 4, key)
    fitting_stages.launch_fitting(launch, 4, key)
    assert tried == [4, 3, 2, 2]
    with pytest.raises(OutOfResources):  # not even one stage fits: the error, not a silent skip
        fitting_stages.launch_fitting(lambda num_stages: launch(num_stages + 2), 3, ("another tile",))
    del fitting_stages.STAGES_THAT_FIT[key]
    tried.clear()

    def broken(num_stages):
        tried.append(num_stages)
        raise ValueError("not a resource limit")

    with pytest.raises(ValueError):  # any other error at once, with the stages asked
        fitting_stages.launch_fitting(broken, 4, ("a broken tile",))
    assert tried == [4]
