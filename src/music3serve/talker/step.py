"""The frame step for all decoding songs, on static buffers: eager, or one CUDA graph per capture size.

One step: sample every song's frame from its pair hiddens (CFG, top-k, the 7 depth-decoder codes), write
the codes, the audio_end flags and the mixed frame conditioning to output buffers, then run the backbone
on the feedback embeddings to get the next hiddens. Positions and frame counters advance on the device,
so replays need no host work unless the set of songs changes.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from .. import contract
from ..models.depth_decoder import DepthDecoder
from ..models.fusion import compiles_sizes_of_one, fusion_enabled
from ..models.language_model import LanguageModel
from .depth_inputs import DepthInputs
from .frame import talker_frame
from .slots import SlotCache


class FrameStep:
    def __init__(
        self,
        lm: LanguageModel,
        depth: DepthDecoder,
        mix: Callable[[torch.Tensor], torch.Tensor],
        slots: SlotCache,
        capture_sizes: list[int],
        use_graphs: bool,
        depth_cache: bool,
    ):
        self.lm, self.depth, self.mix, self.slots, self.depth_cache = lm, depth, mix, slots, depth_cache
        self.depth_inputs = DepthInputs(depth) if depth_cache else None
        rows, songs, device = 2 * slots.pairs, slots.pairs, lm.embed.weight.device
        hidden_size = lm.cfg.hidden
        self.hidden = torch.zeros(rows, hidden_size, dtype=lm.embed.weight.dtype, device=device)
        self.positions = torch.full((rows,), slots.scratch, dtype=torch.int64, device=device)
        self.seeds = torch.zeros(songs, dtype=torch.int64, device=device)
        self.frames = torch.zeros(songs, dtype=torch.int64, device=device)
        self.codes = torch.zeros(songs, contract.NUM_CODEBOOKS, dtype=torch.int64, device=device)
        self.ended = torch.zeros(songs, dtype=torch.bool, device=device)
        self.mixed = torch.zeros(songs, hidden_size, dtype=torch.float32, device=device)
        self.capture_sizes = sorted(s for s in capture_sizes if s <= rows and s % 2 == 0)  # whole pairs only
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The stage's own stream, high priority: graphs captured on it keep its priority and its cuBLAS
        # workspace, which no other stage's graphs share. Steps run (and replay) on it.
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        if use_graphs or fusion_enabled():  # compiles now, not in the first songs (and never during a capture)
            self.warm_up()
        if use_graphs:
            self.capture()

    def run_eager(self, rows: int) -> None:
        songs = rows // 2
        # Where a song count of one would compile graphs of its own (models/fusion.py), a lone song's codes are drawn
        # beside an idle pair's, which are discarded.
        drawn = max(songs, min(2, self.slots.pairs)) if compiles_sizes_of_one() else songs
        frame = talker_frame(
            self.lm, self.depth, self.hidden[: 2 * drawn], self.seeds[:drawn], self.frames[:drawn], self.depth_cache,
            self.depth_inputs,
        )
        self.codes[:songs] = frame.codes[:songs]
        self.ended[:songs] = frame.ended[:songs]
        self.mixed[:songs] = self.mix(frame.conditioning)[:songs]  # every drawn row, for the reason above
        positions = self.positions[:rows]
        backend = self.slots.decode(rows, self.positions)
        self.hidden[:rows] = self.lm(frame.feedback[:rows, None], positions[:, None], backend)[:, 0]
        self.positions[:rows] = torch.where(positions >= self.slots.scratch, positions, positions + 1)
        self.frames[:songs] += 1

    def graph_size(self, rows: int) -> int | None:
        return next((size for size in self.capture_sizes if size >= rows), None)

    def __call__(self, rows: int) -> None:
        """Advance rows [0, rows) by one frame (rows past the active ones must sit at the scratch position)."""
        size = self.graph_size(rows) if self.graphs else None
        if size is None:
            self.run_eager(rows)
        else:
            self.graphs[size].replay()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One eager step of every capture size (kernel selection, Triton and inductor compiles), on the stage's
        stream; buffers are left as they were (rows idle)."""
        with self._restoring_buffers():
            for size in self.capture_sizes:
                self.run_eager(size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per capture size on the stage's stream (after warm_up: capture compiles nothing);
        buffers are left as they were (rows idle)."""
        pool = torch.cuda.graph_pool_handle()
        with self._restoring_buffers():
            for size in reversed(self.capture_sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                    self.run_eager(size)
                self.graphs[size] = graph

    @contextlib.contextmanager
    def _restoring_buffers(self) -> Iterator[None]:
        """Run on the stage's stream, then put the step's inputs back as they were."""
        saved = [t.clone() for t in (self.hidden, self.positions, self.seeds, self.frames)]
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.hidden.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            yield
            for buffer, value in zip((self.hidden, self.positions, self.seeds, self.frames), saved):
                buffer.copy_(value)
        if self.stream is not None:
            self.stream.synchronize()
