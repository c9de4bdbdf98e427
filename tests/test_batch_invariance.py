"""What makes a song's arithmetic independent of the songs beside it, checked without a GPU: the decode attention's
shares, the GEMM dispatch of every row count a frame step has, the depth decoder's first-call attention, the mix
of a frame's conditioning streams, and the chunks a prompt is prefilled in (tests/test_batch_invariance_gpu.py runs
the whole engine on the GPU)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from music3serve.models import depth_decoder, fusion, layers
from music3serve.models.condition_encoder import ConditionEncoder, ConditionEncoderConfig, mix_streams
from music3serve.prompt import encode_prompt
from music3serve.talker.engine import Talker, TalkerConfig

attention = sys.modules["music3serve.kernels.decode_attention"]
skinny = sys.modules["music3serve.kernels.skinny_linear"]
skinny_kernel = sys.modules["music3serve.kernels.skinny_linear_kernel"]


class Launches:
    """Stands in for a Triton kernel: records each launch's grid and constants."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []
        self.constants: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, **constants):
            self.grids.append(grid)
            self.constants.append(constants)

        return launch


@pytest.mark.parametrize("capacity", [16, 300, 2049, 10241])
def test_the_attentions_shares_follow_the_capacity_and_only_its_programs_the_row_count(monkeypatch, capacity):
    """The launch for 1 to 128 rows (a frame step's decode rows, the depth decoder's) cuts every row into the same
    shares, so each row's share of its filled length, and the order its partial results merge in, is the same whatever
    the rows; the programs that take the shares in turn follow the row count (about one per SM of 132)."""
    split, combine = Launches(), Launches()
    fake_triton = SimpleNamespace(next_power_of_2=lambda n: 1 << max(0, n - 1).bit_length())
    monkeypatch.setattr(attention, "triton_kernels", lambda: (fake_triton, split, combine))
    monkeypatch.setattr(attention, "uses_pdl", lambda device: False)
    monkeypatch.setattr(attention, "_sm_count", lambda index: 132)
    shares, row_counts = min(8, -(-capacity // 256)), (1, 2, 3, 16, 17, 64, 128)
    with FakeTensorMode():
        for rows in row_counts:
            q = torch.empty(rows, 32, 128, dtype=torch.bfloat16, device="cuda")
            cache = torch.empty(rows, 8, capacity, 128, dtype=torch.bfloat16, device="cuda")
            lengths = torch.empty(rows, dtype=torch.int32, device="cuda")
            attention._decode_attention_triton(q, cache, cache, lengths)
    assert {(c["NUM_SPLITS"], c["SPLIT_BLOCKS"]) for c in split.constants} == {(shares, 4)}
    assert [g[0] for g in split.grids] == [min(shares, -(-132 // (rows * 8))) for rows in row_counts]
    assert len({tuple(sorted(c.items())) for c in combine.constants}) <= 1  # one merge order for every row count


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 32, 33, 64, 100, 128])
def test_every_row_count_of_a_frame_step_takes_the_row_independent_kernel_on_cuda(monkeypatch, rows):
    """Up to 32 songs: 64 decode rows, 128 in the depth decoder's first call (two positions a row), all in the
    skinny kernel, whose arithmetic per row does not depend on the other rows; beyond 128 rows (prefill) cuBLAS."""
    monkeypatch.setattr(skinny, "triton_available", lambda: True)
    with FakeTensorMode():
        w = torch.empty(4096, 4096, dtype=torch.bfloat16, device="cuda")
        for x in (torch.empty(rows, 4096, dtype=torch.bfloat16, device="cuda"),
                  torch.empty(rows, 1, 4096, dtype=torch.bfloat16, device="cuda")):
            assert layers._skinny(x) and skinny.uses_kernel(x, w)
        if rows % 2 == 0:  # the depth decoder's first call: [rows / 2, 2, hidden]
            assert skinny.uses_kernel(torch.empty(rows // 2, 2, 4096, dtype=torch.bfloat16, device="cuda"), w)
        assert not skinny.uses_kernel(torch.empty(rows + 128, 4096, dtype=torch.bfloat16, device="cuda"), w)


def test_a_songs_prefill_chunks_do_not_depend_on_what_else_is_prefilled(tiny_dir, monkeypatch):
    """A prompt is prefilled in chunks of max_num_batched_tokens // 2 tokens a row whatever else the step prefills
    (a chunk's GEMM shapes set its rounding); a chunk that does not fit waits for the next step."""
    from music3serve.checkpoint import load_models

    models = load_models(tiny_dir, talker_dtype=torch.float32)
    chunks: list[tuple[str, int, int]] = []
    prefill_chunk = Talker._prefill_chunk

    def recorded(self, song, limit):
        chunk = prefill_chunk(self, song, limit)
        chunks.append((song.id, song.prefilled - chunk, chunk))
        return chunk

    monkeypatch.setattr(Talker, "_prefill_chunk", recorded)

    def song_chunks(ids: list[str]) -> list[tuple[int, int]]:
        chunks.clear()
        talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder,
                        TalkerConfig(max_num_seqs=8, max_num_batched_tokens=14))
        for song in ids:
            lyrics = "[verse]\nla la " * (2 + "abc".index(song))
            talker.submit(song, *encode_prompt(models.tokenizer, f"caption {song}", lyrics), seed=0, requested_frames=2)
        while talker.waiting:
            talker.step()
        return [(start, size) for song, start, size in chunks if song == ids[-1]]

    alone = song_chunks(["b"])
    assert len(alone) > 1 and all(size == 7 for _, size in alone[:-1])
    assert song_chunks(["a", "b"]) == alone
    assert song_chunks(["c", "a", "b"]) == alone


@pytest.mark.parametrize("n, k, dtype", [(12288, 4096, torch.bfloat16), (12288, 4096, torch.float8_e4m3fn),
                                         (4096, 12288, torch.float8_e4m3fn)], ids=["bf16", "e4m3", "e4m3 K over warps"])
def test_the_skinny_kernels_launch_takes_its_tiles_from_the_weight_never_the_row_count(monkeypatch, n, k, dtype):
    """Every row count runs the same program on tiles of 16 rows (up to 16 rows) or 32 (beyond; a tile whose K is
    split over the warps keeps 16, its sums' order following the rows on the GPU): the column and K tiles, warps and
    stages follow the weight's shape alone."""
    launches = Launches()
    monkeypatch.setattr(skinny_kernel, "_kernel", lambda: launches)
    monkeypatch.setattr(skinny_kernel, "uses_pdl", lambda device: False)
    fp8 = dtype == torch.float8_e4m3fn
    tile = skinny.tile_config(n, k, fp8=fp8)
    k_over_warps = fp8 and skinny_kernel.VARIANTS[tile[4]][1]
    assert k_over_warps == (n == 4096)  # the measured tiles this test stands on
    with FakeTensorMode():
        w = torch.empty(n, k, dtype=dtype, device="cuda")
        scale = torch.empty(n, dtype=torch.float32, device="cuda") if fp8 else None
        for rows in (1, 2, 16, 17, 32, 64, 128):
            x = torch.empty(rows, k, dtype=torch.bfloat16, device="cuda")
            skinny_kernel.run_kernel(x, w, tile, scale=scale)
    block_m = [16] * 7 if k_over_warps else [16, 16, 16, 32, 32, 32, 32]
    assert [c["BLOCK_M"] for c in launches.constants] == block_m
    assert [g[0] for g in launches.grids] == [-(-rows // m) for rows, m in zip((1, 2, 16, 17, 32, 64, 128), block_m)]
    assert len({(c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"], c.get("WORDS"), c.get("PARTS"))
                for c in launches.constants}) == 1


def test_the_first_depth_calls_attention_runs_the_decode_kernel_a_position_at_a_time(monkeypatch):
    """In bf16 on CUDA the depth decoder's first call (two positions a song; all of them without its cache) attends
    position 0 to its own value and each later position through decode attention over the positions up to it, never
    through SDPA, whose kernels follow the batch size. With the decode attention's torch reference standing in for the
    kernel, that is SDPA's causal attention."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 5, 4, 3, 16, generator=gen).bfloat16()  # 5 rows, 4 heads, 3 positions of 16
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    monkeypatch.setattr(depth_decoder, "takes_rotation", lambda device: True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", None)  # called, it would raise
    steps = torch.arange(17)[:, None].expand(-1, 5).contiguous()
    got = depth_decoder.causal_attention(q, k, v, steps).view(5, 3, 4, 16)
    assert torch.equal(got[:, 0], v[:, :, 0])  # softmax over one key: the value itself
    torch.testing.assert_close(got.float(), want.transpose(1, 2), rtol=1e-2, atol=1e-2)
    alone = depth_decoder.causal_attention(q[1:2], k[1:2], v[1:2], steps[:, :1])
    assert torch.equal(alone, got[1:2].flatten(2))


def test_a_frames_mix_is_elementwise_compiled_so_the_same_alone_and_beside_other_frames():
    """The talker mixes one frame a song. The compiled mix holds no reduction (a reduction kernel's order follows its
    launch configuration, which inductor picks per compiled shape), only the weighted streams added one after the
    other, so a frame's mix has the same bits alone, beside one frame or beside seven (here inductor on the CPU)."""
    encoder = ConditionEncoder(ConditionEncoderConfig(hidden=16, streams=8, out_dim=4))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        encoder.stream_logits.normal_(generator=gen)
    frames = torch.randn(8, 8 * 16, generator=gen)
    ops: list[str] = []

    def traced(gm: torch.fx.GraphModule, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        return gm

    compiled = torch.compile(mix_streams.__wrapped__, backend=traced, dynamic=True, fullgraph=True)
    compiled(frames, torch.softmax(encoder.stream_logits.detach(), dim=0), encoder.scale.detach())
    assert ops and not [op for op in ops if any(r in op for r in ("sum", "mean", "max", "softmax", "reduce"))], ops
    fusion.enable_fusion()
    with torch.no_grad():
        together = encoder.mix(frames)
        for rows in (1, 2):
            assert torch.equal(encoder.mix(frames[:rows]), together[:rows])
