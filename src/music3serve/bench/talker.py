"""`music3serve bench talker`: ms per frame step for 1/2/4/8 songs on the full-size model (random weights)."""

from __future__ import annotations

import time

import torch

from .. import contract
from ..prompt import unconditional_ids
from ..talker.config import TalkerConfig
from ..talker.engine import Talker
from ..talker.frame import semantic_draw, talker_frame
from ..talker.quantize import quantize_talker
from . import attention
from .common import copy_bandwidth, graphed, param_bytes, random_module, table, time_ms


def weight_floor_ms(lm, depth, looked_up: bool = False) -> float:
    """Bytes one frame must read once, at copy bandwidth: backbone layers + restricted head, depth decoder x 7 calls
    (the floor of docs/performance.md). looked_up: calls 2..7 without the projection and first qkv weights
    (DepthInputs), what the cached depth calls read."""
    backbone = param_bytes(lm) - lm.embed.weight.numel() * lm.embed.weight.element_size()
    depth_call = param_bytes(depth) - depth.embed.weight.numel() * depth.embed.weight.element_size()
    depth_call -= param_bytes(depth.heads) * 6 // 7  # one head per call
    skipped = param_bytes(depth.projection) + param_bytes(depth.blocks[0].qkv) if looked_up else 0
    return (backbone + 7 * depth_call - (contract.NUM_CODEBOOKS - 2) * skipped) / copy_bandwidth() * 1e3


def admit(talker: Talker, songs: int, prompt_tokens: int) -> None:
    gen = torch.Generator().manual_seed(songs)
    for i in range(songs):
        ids = torch.randint(0, 151643, (prompt_tokens,), generator=gen).tolist()
        talker.submit(f"bench{i}", ids, unconditional_ids(ids), seed=i, requested_frames=contract.MAX_FRAMES)
    while talker.waiting:
        talker.step()
    torch.cuda.synchronize()  # the step left queued on the talker's stream must not overlap what is timed next


def split_ms(talker: Talker, rows: int) -> dict[str, float]:
    """Graph-timed parts of one step: sampling, the depth loop (frame minus sampling), the backbone."""
    step, lm, depth = talker.step_fn, talker.lm, talker.depth
    songs = rows // 2
    hidden, seeds, frames = step.hidden[:rows], step.seeds[:songs], step.frames[:songs]
    positions = step.positions[:rows]
    feedback = hidden.clone()
    parts = {
        "sampling": lambda: semantic_draw(hidden, lm.head.weight, seeds, frames),
        "frame": lambda: talker_frame(lm, depth, hidden, seeds, frames, step.depth_cache, step.depth_inputs),
        "backbone": lambda: lm(feedback[:, None], positions[:, None], talker.slots.decode(rows, positions)),
    }
    ms = {name: time_ms(graphed(fn)) for name, fn in parts.items()}
    return {"backbone": ms["backbone"], "depth": ms["frame"] - ms["sampling"], "sampling": ms["sampling"]}


def measure(talker: Talker, concurrency, prompt_tokens: int, steps: int, floor: float, label: str = "bf16"
            ) -> list[list]:
    """One table row per concurrency level: graph and engine step times, the split, the ratio to the floor."""
    out = []
    for songs in concurrency:
        admit(talker, songs, prompt_tokens)
        rows = 2 * songs
        graph_ms = time_ms(lambda: talker.step_fn(rows), repeat=steps)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            talker.step()
        torch.cuda.synchronize()  # the last step is still queued when step() returns
        engine_ms = (time.perf_counter() - started) / steps * 1e3
        parts = split_ms(talker, rows)
        out.append([label, songs, "cached" if talker.step_fn.depth_cache else "recomputed", graph_ms, engine_ms,
                    parts["backbone"], parts["depth"], parts["sampling"], graph_ms / floor])
        for song in list(talker.songs):
            talker.cancel(song)
    return out


@torch.inference_mode()
def run(
    device: str = "cuda", concurrency=(1, 2, 4, 8), prompt_tokens: int = 300, steps: int = 50, peers: bool = True,
    depth_modes=(False, True), quantization: str = "none",
) -> str:
    """quantization "fp8": the same weights measured again as e4m3 (models/fp8.py) after the bf16 rows, each row's
    ratio to the floor of its own weight bytes."""
    lm = random_module("language_model", device, torch.bfloat16)
    depth = random_module("depth_decoder", device, torch.bfloat16, seed=1)
    encoder = random_module("condition_encoder", device, torch.float32, seed=2)
    rows_out, floors = [], []
    for label in ("bf16", "fp8") if quantization == "fp8" else ("bf16",):
        if label == "fp8":
            quantize_talker(lm, depth)
        floor = weight_floor_ms(lm, depth)
        floors.append(f"{label} {floor:.2f} ms (cached depth calls read less: "
                      f"{weight_floor_ms(lm, depth, looked_up=True):.2f} ms)")
        for depth_cache in depth_modes:
            config = TalkerConfig(max_num_seqs=16, capture_sizes=(2, 4, 8, 16), depth_cache=depth_cache)
            rows_out += measure(Talker(lm, depth, encoder, config), concurrency, prompt_tokens, steps, floor, label)
            torch.cuda.empty_cache()
    headers = ["weights", "songs", "depth calls", "step ms (graph)", "step ms (engine, with host)", "backbone ms",
               "depth loop ms", "sampling ms", "x weight-read floor"]
    out = f"weight-read floor for one frame: {'; '.join(floors)}\n\n" + table(headers, rows_out)
    del lm, depth, encoder
    torch.cuda.empty_cache()
    out += "\n\n" + attention.run()
    if peers:
        from .peers import diffusers_frame_ms

        out += f"\n\ndiffusers 0.42.1, one song, bf16: {diffusers_frame_ms(device, prompt_tokens=prompt_tokens):.1f} ms per frame"
    return out
