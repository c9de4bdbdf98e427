"""A row's bits do not depend on the rows beside it, through the launchers the frame step calls, under the interpreter:
decode attention as the talker's backbone calls it (the launcher picks its shares and programs), the skinny GEMMs as the depth
decoder's blocks call them (bf16 and e4m3 weights; its first call two positions a row) and the depth decoder's calls
of a frame. Each row's result is compared bit for bit alone and beside 1, 3, 7 and 15 other rows (the GEMMs: up to 63)
of other contents and lengths, with fresh garbage past every row's length.

The CPU stands in for CUDA: the launchers' own device checks are answered as for CUDA tensors, the kernels and their
launch choices are untouched. That proves the launch side (grids, tiles, split shares, which rows a program reads);
the interpreter's float32 dot is not the GPU's, so that a 16- and a 32-row tile multiply a row alike on the GPU is
for tests/test_batch_invariance_gpu.py."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from music3serve.models import depth_decoder, layers
from music3serve.models.depth_decoder import DepthDecoder, DepthDecoderConfig, DepthKV
from music3serve.models.fp8 import quantize_linears, quantize_parameter
from music3serve.models.layers import rope_angles

attention = importlib.import_module("music3serve.kernels.decode_attention")
skinny = importlib.import_module("music3serve.kernels.skinny_linear")

# One KV head of the talker's and its GQA group of 4 query heads of 128 (its 8 KV heads are 8 times the programs, each
# reading its own head); a slot of max_model_len 2560 and its scratch position, for which the launcher takes its full
# 8 splits (as for 10241). A split's share is 4 blocks of 64 positions (256), more once a row holds over 8 shares
# (2048): lengths either side of those edges, the last position, and a padded row (length 1, writing the scratch
# position).
Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 4, 1, 128, 2561
PADDED = 0  # stands for the padded row's length in LENGTHS
LENGTHS = [1, 2, 64, 65, 255, 256, 257, 511, 512, 513, 1000, 2047, 2048, 2049, 2560, PADDED]
COMPANY = (1, 2, 4, 8, 16)  # rows per call: a row alone and beside 1, 3, 7 and 15 others


@pytest.fixture(autouse=True)
def launches(monkeypatch) -> dict[str, list[tuple[int, ...]]]:
    """The launchers' device checks answered for the CPU as for CUDA: decode attention and the depth decoder's first
    call take the Triton path, bf16 rows the skinny ops, and those ops' own rule (row counts, dtypes, strides) decides
    about CUDA tensors of the same shapes, dtypes and strides. Returns the shape of each launch's first input, per
    launcher, and under "refused" those of the GEMM inputs the rule sent to the torch ops: the tests check that the
    kernels ran, and for every row count."""
    shapes: dict[str, list[tuple[int, ...]]] = {"attention": [], "skinny": [], "refused": []}
    rule = skinny.uses_kernel

    def uses_kernel_on_cuda(x: torch.Tensor, w: torch.Tensor) -> bool:
        with FakeTensorMode():
            taken = rule(*(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") for t in (x, w)))
        if not taken:
            shapes["refused"].append(tuple(x.shape))
        return taken

    def recorded(name: str, launcher: Callable) -> Callable:
        def launch(x: torch.Tensor, *args, **kwargs):
            shapes[name].append(tuple(x.shape))
            return launcher(x, *args, **kwargs)

        return launch

    monkeypatch.setattr(attention, "takes_rotation", lambda device: True)
    monkeypatch.setattr(depth_decoder, "takes_rotation", lambda device: True)
    monkeypatch.setattr(layers, "_skinny", lambda x: x.dtype == torch.bfloat16)
    monkeypatch.setattr(skinny, "uses_kernel", uses_kernel_on_cuda)
    monkeypatch.setattr(attention, "_decode_attention_triton",
                        recorded("attention", attention._decode_attention_triton))
    monkeypatch.setattr(skinny, "run_kernel", recorded("skinny", skinny.run_kernel))
    return shapes


def calls(rows: int, tracked: int) -> list[list[int]]:
    """Calls of 2, 4, 8 and 16 of `rows` rows, shuffled: those that seat one of the first `tracked` rows, so that each
    of them sits once beside 1, 3, 7 and 15 others, at some place among them."""
    seated = []
    for size in COMPANY[1:]:
        order = torch.randperm(rows).tolist()
        seated += [call for call in (order[i : i + size] for i in range(0, rows, size)) if min(call) < tracked]
    return seated


def garbage(shape: tuple[int, ...]) -> torch.Tensor:
    """What a free position may hold: stale values of any size, NaN and inf."""
    values = torch.randn(shape) * 1e4
    values.view(-1)[torch.randint(0, values.numel(), (values.numel() // 50,))] = float("nan")
    values.view(-1)[torch.randint(0, values.numel(), (values.numel() // 50,))] = float("inf")
    return values.to(torch.bfloat16)


@dataclass
class Row:
    """One talker row of a decode step: its slot's filled keys and values, its new token's projections."""

    length: int
    position: int
    q: torch.Tensor  # [Q_HEADS, HEAD_DIM]
    k_new: torch.Tensor  # [KV_HEADS, HEAD_DIM]
    v_new: torch.Tensor
    k: torch.Tensor  # [KV_HEADS, CAPACITY, HEAD_DIM], filled before `position`
    v: torch.Tensor

    @classmethod
    def drawn(cls, length: int) -> Row:
        position = CAPACITY - 1 if length == PADDED else length - 1
        q, k_new, v_new = (torch.randn(heads, HEAD_DIM).to(torch.bfloat16) for heads in (Q_HEADS, KV_HEADS, KV_HEADS))
        k, v = (torch.randn(KV_HEADS, CAPACITY, HEAD_DIM).to(torch.bfloat16) for _ in range(2))
        return cls(max(length, 1), position, q, k_new, v_new, k, v)

    def seen(self) -> torch.Tensor:
        """The slot positions the step reads or writes."""
        return torch.cat([torch.arange(self.length), torch.tensor([self.position])]).unique()


def talker_attention(rows: list[Row], q_norm: torch.Tensor, k_norm: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """One backbone layer's decode attention over `rows` as the talker calls it (talker/slots.py: the new key and
    value appended, q and the key normed and rotated in the kernel); per row its output and its slot's keys and
    values at the positions it saw. Positions past each row's filled ones hold fresh garbage."""
    k, v = (torch.stack([getattr(r, name) for r in rows]) for name in ("k", "v"))
    for i, r in enumerate(rows):
        filled = 1 if r.position == CAPACITY - 1 else r.position
        for cache in (k, v):
            cache[i, :, filled:] = garbage(cache[i, :, filled:].shape)
    positions = torch.tensor([r.position for r in rows])
    lengths = torch.tensor([r.length for r in rows], dtype=torch.int32)
    cos, sin = (t[:, 0].contiguous() for t in rope_angles(positions[:, None], HEAD_DIM, 1_000_000.0))
    new = tuple(torch.stack([getattr(r, name) for r in rows]) for name in ("k_new", "v_new"))
    out = attention.decode_attention(torch.stack([r.q for r in rows]), k, v, lengths, append=(*new, positions),
                                     rotation=(q_norm, k_norm, 1e-6, cos, sin))
    return [(out[i], k[i][:, r.seen()], v[i][:, r.seen()]) for i, r in enumerate(rows)]


@pytest.mark.parametrize("programs", ["one per share", "fewer beside more rows"])
def test_the_talkers_decode_attention_gives_a_row_the_same_bits_beside_any_rows(launches, monkeypatch, programs):
    """The share count is the launcher's, from the capacity alone; a row's shares of its filled length, and so the
    order its positions are summed and merged in, follow its own length. The programs that take the shares follow the
    row count on a GPU (one per share here): with 8 programs a KV head alone and 1 beside 15 rows, a row's bits stay."""
    if programs != "one per share":
        monkeypatch.setattr(attention, "_choose_programs", lambda rows, kv_heads, splits, device: max(1, splits // rows))
    rows = [Row.drawn(n) for n in LENGTHS]
    q_norm, k_norm = ((1 + 0.2 * torch.randn(HEAD_DIM)).to(torch.bfloat16) for _ in range(2))
    alone = [talker_attention([r], q_norm, k_norm)[0] for r in rows]
    assert all(out.isfinite().all() for out, _, _ in alone)
    for call in calls(len(rows), len(rows)):
        for i, got in zip(call, talker_attention([rows[i] for i in call], q_norm, k_norm)):
            for name, a, b in zip(("output", "keys", "values"), got, alone[i]):
                assert torch.equal(a, b), f"length {LENGTHS[i]} beside {len(call) - 1} rows: its {name} changed"
    assert sorted(shape[0] for shape in launches["attention"]) == [1] * len(rows) + [2] * 8 + [4] * 4 + [8] * 2 + [16]
    assert attention._choose_num_splits(CAPACITY, attention._BLOCK_N) == 8


# A depth decoder small enough for the interpreter: one head of 32 and the tile rule's smallest tiles (16 columns).
DEPTH = DepthDecoderConfig(hidden=32, layers=1, heads=1, mlp=32, codes=16, codebooks=8, positions=16)


def depth_decoder_of(fp8: bool) -> DepthDecoder:
    """Random weights of realistic scale in bf16, or as `quantization: fp8` holds them (talker/quantize.py)."""
    decoder = DepthDecoder(DEPTH)
    with torch.no_grad():
        for name, p in decoder.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    decoder = decoder.to(torch.bfloat16).eval().requires_grad_(False)
    if fp8:
        quantize_linears(decoder)
        quantize_parameter(decoder, "heads")
    return decoder


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_the_depth_blocks_gemms_give_a_row_the_same_bits_for_every_row_count_of_a_frame_step(fp8, launches):
    """A depth block's projections and feed-forward (q | k | v; o plus the residual; the gated SwiGLU half; down plus
    the residual) on one row, alone and beside up to 63 others: a frame step of up to 32 songs (64 rows), whose first
    depth call holds two positions a row, so 128 GEMM rows in tiles of 16 or 32."""
    block = depth_decoder_of(fp8).blocks[0]
    mlp = (block.o.weight, block.mlp_norm.weight, block.mlp.gate_up.weight, block.mlp.down.weight, 1e-6)

    def gemms(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both, as the blocks call them: every position a row of its own (layers.as_tokens), viewed back."""
        tokens = layers.as_tokens(x)
        qkv = depth_decoder.depth_qkv(tokens, block.attn_norm.weight, block.qkv.weight, 1e-6)
        out = layers.residual_mlp(tokens, tokens.flip(-1), *mlp)  # any attention output: its bits are not the point
        return qkv.view(*x.shape[:2], -1), out.view(x.shape)

    for positions in (2, 1):  # the first call, then each cached one
        row = torch.randn(1, positions, DEPTH.hidden).to(torch.bfloat16)
        alone = gemms(row)
        for rows in (2, 4, 8, 16, 32, 64):
            x = torch.randn(rows, positions, DEPTH.hidden).to(torch.bfloat16)
            at = rows * 3 // 4
            x[at] = row[0]
            for got, want in zip(gemms(x), alone):
                assert torch.equal(got[at : at + 1], want), f"{positions} positions, beside {rows - 1} rows"
    assert not launches["refused"] and (128, 1, DEPTH.hidden) in launches["skinny"]


def depth_frame(decoder: DepthDecoder, first: torch.Tensor, later: torch.Tensor, cached: bool) -> list[torch.Tensor]:
    """A frame's first two depth calls as talker/frame.py makes them: the first two positions, then one more, on the
    cached keys (as each later call) or with the whole sequence recomputed (depth_cache off); each call's last hidden
    state and its codebook's logits."""
    cache, outs = DepthKV() if cached else None, []
    for codebook, positions in enumerate((first, later if cached else torch.cat((first, later), dim=1)), start=1):
        hidden = decoder(positions, cache, positioned=True)[:, -1]
        outs += [hidden, decoder.head_logits(hidden, codebook, widen=False)]
    return outs


@pytest.mark.parametrize("fp8,cached", [(False, True), (True, True), (False, False)],
                         ids=["bf16", "e4m3", "bf16-recomputed"])
def test_the_depth_decoders_calls_give_a_row_the_same_bits_beside_any_rows(fp8, cached, launches):
    """The first call's attention runs decode attention a position at a time (so does a recomputed call), a cached call
    appends to the cache's buffers (which start uninitialized); the GEMMs take the skinny kernel. Four rows tracked,
    in calls of up to 16."""
    decoder, rows = depth_decoder_of(fp8), max(COMPANY)
    first, later = (torch.randn(rows, positions, DEPTH.hidden).to(torch.bfloat16) for positions in (2, 1))
    alone = [depth_frame(decoder, first[i : i + 1], later[i : i + 1], cached) for i in range(4)]
    seated = calls(rows, len(alone))
    for call in seated:
        outs = depth_frame(decoder, first[call], later[call], cached)
        for at, i in enumerate(call):
            for n, out in enumerate(outs if i < len(alone) else ()):
                assert torch.equal(out[at : at + 1], alone[i][n]), f"output {n} beside {len(call) - 1} rows"
    assert not launches["refused"] and (2 * rows, 1, DEPTH.hidden) in launches["skinny"]  # both positions as rows
    per_frame = 2 if cached else 3  # one launch for each position after the first that a call attends from
    assert len(launches["attention"]) == per_frame * (len(alone) + len(seated))
