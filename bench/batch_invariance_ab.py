"""The talker frame step (graph) with its batch-invariant dispatch against the row-count-dependent one it replaced,
interleaved in one process so that clock drift cancels. Full-size model, random weights, prompts of 300 tokens.

"row-count" rebuilds the earlier choices: the decode attention's split count from the row count (about one program
per SM at full length: ceil(SMs / (rows x kv_heads)) splits, at most one per block of the capacity, shares of any
size), more than 16 rows of a GEMM in cuBLAS, and SDPA in the depth decoder's first call. "invariant" is the engine as
it is: a row's shares from its length alone (at most 8, of at least 4 blocks), taken in turn by programs whose count
follows the row count; every row count up to 128 in the skinny kernel; the first depth call's attention in the decode
kernel. The other "invariant" rows try smaller shares. The talkers share the weights; each has its own KV slots and
graphs. Then the decode attention alone (36 layers in one graph, per layer) at 2 and 16 rows: each rule, a program
per share (the invariant shares without the row-count programs), and fixed split counts.

    PYTHONPATH=src python3 bench/batch_invariance_ab.py [--quick]

--quick: the engine's dispatch against the row-count one alone, the talker step only (about half the time).
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch

from music3serve.bench.attention import CAPACITY, KV_HEADS, LAYERS, AttentionCase
from music3serve.bench.common import graphed, interleaved_ms, random_module, table
from music3serve.bench.talker import admit
from music3serve.talker.engine import Talker, TalkerConfig

attention = sys.modules["music3serve.kernels.decode_attention"]
skinny = sys.modules["music3serve.kernels.skinny_linear"]
depth_decoder = sys.modules["music3serve.models.depth_decoder"]


def row_count_splits(rows: int, kv_heads: int, capacity: int) -> int:
    """The split count the attention took from the row count before."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, min(math.ceil(sms / max(1, rows * kv_heads)), math.ceil(capacity / attention._BLOCK_N), 128))


@contextlib.contextmanager
def row_count_dispatch():
    """The earlier, row-count-dependent choices, while a talker is built and captured."""
    saved = attention._decode_attention_triton, skinny.MAX_ROWS, depth_decoder.takes_rotation
    triton_path = saved[0]

    def by_rows(q, k_cache, v_cache, lengths, scale=None, **kw):
        kw.setdefault("num_splits", row_count_splits(q.shape[0], k_cache.shape[1], k_cache.shape[2]))
        kw.setdefault("split_blocks", 1)
        kw.setdefault("programs", kw["num_splits"])
        return triton_path(q, k_cache, v_cache, lengths, scale, **kw)

    # takes_rotation False: the depth decoder's first call runs SDPA
    attention._decode_attention_triton, skinny.MAX_ROWS, depth_decoder.takes_rotation = by_rows, 16, lambda _: False
    try:
        yield
    finally:
        attention._decode_attention_triton, skinny.MAX_ROWS, depth_decoder.takes_rotation = saved


@contextlib.contextmanager
def shares_of(blocks: int):
    """The engine's invariant attention with shares of at least `blocks` blocks, while a talker is built and captured."""
    saved = attention._decode_attention_triton

    def with_shares(q, k_cache, v_cache, lengths, scale=None, **kw):
        kw.setdefault("split_blocks", blocks)
        return saved(q, k_cache, v_cache, lengths, scale, **kw)

    attention._decode_attention_triton = with_shares
    try:
        yield
    finally:
        attention._decode_attention_triton = saved


SPLIT_BLOCKS = (1, 2, 4)  # the smallest share the sweep tries, in blocks (the engine's: 4)
PROMPTS = (300, 2000)  # a song's filled length early on and some 70 s in


@torch.inference_mode()
def main(quick: bool = False) -> None:
    lm = random_module("language_model", "cuda", torch.bfloat16)
    depth = random_module("depth_decoder", "cuda", torch.bfloat16, seed=1)
    encoder = random_module("condition_encoder", "cuda", torch.float32, seed=2)
    config = TalkerConfig(max_num_seqs=16, max_model_len=4096, capture_sizes=(2, 4, 8, 16), gpu_memory_utilization=0.9)
    talkers = {}
    dispatches = {"row-count": row_count_dispatch, "invariant": contextlib.nullcontext,
                  **{f"invariant, shares >= {n} blocks": lambda n=n: shares_of(n) for n in SPLIT_BLOCKS if n != 4}}
    if quick:
        dispatches = {name: dispatches[name] for name in ("row-count", "invariant")}
    for name, dispatch in dispatches.items():
        with dispatch():
            talkers[name] = Talker(lm, depth, encoder, config)
    headers = ["songs", "prompt tokens", "dispatch", "step ms (graph)", "vs row-count"]
    rows = []
    for songs in (1, 8):
        for prompt in PROMPTS:
            for talker in talkers.values():
                admit(talker, songs, prompt)
            times = interleaved_ms({name: (lambda t=t: t.step_fn(2 * songs)) for name, t in talkers.items()})
            rows += [[songs, prompt, name, ms, ms / times["row-count"]] for name, ms in times.items()]
            print(table(headers, rows[-len(times):]), flush=True)
            for talker in talkers.values():
                for song in list(talker.songs):
                    talker.cancel(song)
                torch.cuda.synchronize()
    print(table(headers, rows))
    del talkers, lm, depth, encoder
    torch.cuda.empty_cache()
    if quick:
        return

    out = []
    for n_rows in (2, 16):
        case = AttentionCase(n_rows)
        for filled in (384, 1024, 4096):
            case.set_length(filled)
            by_rows = row_count_splits(n_rows, KV_HEADS, CAPACITY)
            rules = ({"row-count": {"num_splits": by_rows, "split_blocks": 1, "programs": by_rows}, "invariant": {}}
                     | {f"invariant, shares >= {n} blocks": {"split_blocks": n} for n in SPLIT_BLOCKS if n != 4}
                     | {"invariant, a program per share": {"programs": 8}}
                     | {f"{n} splits": {"num_splits": n, "split_blocks": 1, "programs": n} for n in (1, 2, 4, 6, 8)})
            replays = {
                name: graphed(lambda kw=kw: [attention._decode_attention_triton(
                    case.q[i], case.k[i], case.v[i], case.lengths, **kw) for i in range(LAYERS)])
                for name, kw in rules.items()
            }
            times = interleaved_ms(replays, rounds=5)
            out += [[n_rows, filled, name, ms * 1e3 / LAYERS, ms / times["row-count"]] for name, ms in times.items()]
        del case
        torch.cuda.empty_cache()
    print(table(["rows", "filled", "splits", "us per layer", "vs row-count"], out))


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
