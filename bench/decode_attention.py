"""Decode attention benchmark: our Triton kernel (reads only filled KV rows) against attending over the whole
capacity (torch SDPA over the full cache with a mask) and against the bytes floor.

Talker shapes (Qwen3-8B backbone): 32 query heads, 8 KV heads, head_dim 128, bf16 cache of capacity 10240,
36 layers. One timed unit is 36 calls, one per layer (each layer's cache is its own memory, as in a decode step),
replayed from a CUDA graph as the engine runs it; times are the median of triton.testing.do_bench, divided by 36.
The eager column is the same 36 calls launched from Python (launch overhead included).

Floor: filled K+V bytes / 4.29e12 B/s (device-to-device copy bandwidth measured on an H200).

    PYTHONPATH=src python3 bench/decode_attention.py [--sweep]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from music3serve.kernels.decode_attention import (
    _BLOCK_N,
    _choose_num_splits,
    _decode_attention_triton,
    _sm_count,
    decode_attention,
    decode_attention_reference,
)

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 36, 32, 8, 128, 10240
FILLED = (1024, 5120, 10240)
ROWS = (2, 16)
FLOOR_BW = 4.29e12


def _bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _graph_of(fn):
    """Capture fn (after warm-up on a side stream) and return the replay callable."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay


class Case:
    def __init__(self, rows: int):
        self.rows = rows
        shape = (LAYERS, rows, KV_HEADS, CAPACITY, HEAD_DIM)
        self.k = torch.empty(shape, device="cuda", dtype=torch.bfloat16).normal_()
        self.v = torch.empty(shape, device="cuda", dtype=torch.bfloat16).normal_()
        self.q = torch.randn(LAYERS, rows, Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
        self.lengths = torch.full((rows,), CAPACITY, device="cuda", dtype=torch.int32)
        self.mask = torch.ones(rows, 1, 1, CAPACITY, device="cuda", dtype=torch.bool)

    def set_length(self, n: int) -> None:
        self.lengths.fill_(n)
        self.mask.copy_((torch.arange(CAPACITY, device="cuda") < self.lengths[:, None])[:, None, None, :])

    def ours(self, **kw):
        if kw:
            return lambda: [_decode_attention_triton(self.q[i], self.k[i], self.v[i], self.lengths, **kw)
                            for i in range(LAYERS)]  # fmt: skip
        return lambda: [decode_attention(self.q[i], self.k[i], self.v[i], self.lengths) for i in range(LAYERS)]

    def sdpa_one(self, i: int) -> torch.Tensor:
        # GQA as a 4-token query per KV head: [rows, kv_heads, group, head_dim] against [rows, kv_heads, C, D].
        q = self.q[i].view(self.rows, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
        o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=self.mask)
        return o.reshape(self.rows, Q_HEADS, HEAD_DIM)

    def sdpa(self):
        return lambda: [self.sdpa_one(i) for i in range(LAYERS)]

    def free(self) -> None:
        del self.k, self.v, self.q


def _per_call_us(ms: float) -> float:
    return ms * 1e3 / LAYERS


def _floor_us(rows: int, n: int) -> float:
    return rows * KV_HEADS * n * HEAD_DIM * 2 * 2 / FLOOR_BW * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time other block sizes / warps / stages / splits")
    args = ap.parse_args()

    import triton

    dev = torch.cuda.get_device_name()
    sms = _sm_count(torch.cuda.current_device())
    print(f"device {dev} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}")
    print(f"shapes: {LAYERS} layers x [rows, q {Q_HEADS} / kv {KV_HEADS} heads, capacity {CAPACITY}, dim {HEAD_DIM}] "
          "bf16; per call = one layer; median of triton.testing.do_bench over 36 calls / 36")  # fmt: skip
    header = (f"{'rows':>4} {'filled':>6} {'splits':>6} | {'ours graph us':>13} {'ours eager us':>13} | "
              f"{'full-cache SDPA us':>18} | {'floor us':>8} | {'ours/floor':>10} {'SDPA/ours':>9} {'ours TB/s':>9}")  # fmt: skip
    rows_out = []
    sweep_out = []
    for rows in ROWS:
        case = Case(rows)
        splits = _choose_num_splits(rows, KV_HEADS, CAPACITY, _BLOCK_N, sms)
        for n in FILLED:
            case.set_length(n)
            # sanity: ours, SDPA and the reference agree on layer 0
            o = decode_attention(case.q[0], case.k[0], case.v[0], case.lengths).float()
            ref = decode_attention_reference(case.q[0].float(), case.k[0], case.v[0], case.lengths)
            s = case.sdpa_one(0).float()
            err = ((o - ref).abs().max() / ref.abs().max()).item()
            err_s = ((s - ref).abs().max() / ref.abs().max()).item()
            del o, ref, s
            ours_g = _per_call_us(_bench_ms(_graph_of(case.ours())))
            ours_e = _per_call_us(_bench_ms(case.ours()))
            sdpa_g = _per_call_us(_bench_ms(_graph_of(case.sdpa())))
            floor = _floor_us(rows, n)
            tbs = rows * KV_HEADS * n * HEAD_DIM * 4 / (ours_g * 1e-6) / 1e12
            rows_out.append(
                f"{rows:>4} {n:>6} {splits:>6} | {ours_g:>13.2f} {ours_e:>13.2f} | {sdpa_g:>18.2f} | {floor:>8.2f} | "
                f"{ours_g / floor:>10.2f} {sdpa_g / ours_g:>9.2f} {tbs:>9.2f}   (rel err ours {err:.1e}, "
                f"SDPA {err_s:.1e})"
            )  # fmt: skip
            print(rows_out[-1], flush=True)
            if args.sweep:
                for block_n in (32, 64, 128):
                    for num_warps in (4, 8):
                        for num_stages in (2, 3, 4):
                            kw = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                                      num_splits=_choose_num_splits(rows, KV_HEADS, CAPACITY, block_n, sms))  # fmt: skip
                            try:
                                t = _per_call_us(_bench_ms(_graph_of(case.ours(**kw))))
                            except Exception as e:  # e.g. out of shared memory
                                t = math.nan
                                print(f"  sweep {kw}: {type(e).__name__}: {str(e)[:100]}")
                            sweep_out.append((rows, n, t, kw))
                for mult in (0.25, 0.5, 2, 4):
                    ns = max(1, int(splits * mult))
                    kw = dict(num_splits=ns)
                    t = _per_call_us(_bench_ms(_graph_of(case.ours(**kw))))
                    sweep_out.append((rows, n, t, kw))
        case.free()
        torch.cuda.empty_cache()

    print()
    print(header)
    print("-" * len(header))
    for line in rows_out:
        print(line)
    if sweep_out:
        print("\nsweep (graph replay, us per call), best 6 per case:")
        for rows in ROWS:
            for n in FILLED:
                res = sorted(((t, kw) for r, m, t, kw in sweep_out if r == rows and m == n and not math.isnan(t)),
                             key=lambda x: x[0])
                print(f"rows {rows} filled {n}: " + "; ".join(f"{t:.2f} {kw}" for t, kw in res[:6]))


if __name__ == "__main__":
    main()
