"""Stage 0 engine: songs join and leave between steps; each step prefills within a token budget, then
advances every decoding song by one frame and hands out the windows that became ready."""

from __future__ import annotations

import contextlib
import logging
from collections import deque

import torch

from .. import contract
from ..errors import InputError, Music3Error
from ..hashing import as_int64
from ..kernels.pdl import pdl_mode
from ..kernels.skinny_linear_kernel import ROW_TILE
from ..models.condition_encoder import ConditionEncoder
from ..models.depth_decoder import DepthDecoder
from ..models.fusion import enable_fusion, fusion_enabled
from ..models.language_model import LanguageModel
from .bookkeeping import InFlightStep, TalkerSong, new_song
from .config import TalkerConfig
from .events import Event, SongFailed, SongFinished
from .memory_check import check_memory
from .slots import SlotCache
from .step import FrameStep

log = logging.getLogger(__name__)


class Talker:
    def __init__(self, lm: LanguageModel, depth: DepthDecoder, encoder: ConditionEncoder, config: TalkerConfig):
        if config.max_num_seqs < 2 or config.max_num_seqs % 2:
            raise Music3Error(f"max_num_seqs counts cond/uncond rows and must be even and >= 2, got {config.max_num_seqs}")
        if config.max_num_batched_tokens < 2:
            raise Music3Error("max_num_batched_tokens counts both rows of a pair and must be >= 2 (else no prompt is "
                              f"ever prefilled), got {config.max_num_batched_tokens}")
        pdl_mode()  # a bad MUSIC3SERVE_PDL fails here, at startup, not at the first kernel launch
        self.lm, self.depth, self.encoder, self.config = lm, depth, encoder, config
        self.device = lm.embed.weight.device
        pairs = config.max_num_seqs // 2
        check_memory(lm, depth, pairs, config)
        self.slots = SlotCache(lm.cfg, pairs, config.max_model_len, lm.embed.weight.dtype, self.device)
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        if config.fuse and self.device.type == "cuda":
            enable_fusion()
        self.step_fn = FrameStep(
            lm, depth, self._mix, self.slots, list(config.capture_sizes), use_graphs, config.depth_cache
        )
        if fusion_enabled():  # on the CPU too where a caller enabled fusion: compiles now, not in the first songs
            self.warm_prefill()
        # Step outputs come back through pinned buffers and an event on the talker's own stream: a pageable
        # copy could wait for work of other streams (the renderer's long DiT graphs) before returning. Two of
        # each: the host reads one step's results while the next step, already queued, copies into the other.
        pinned = self.device.type == "cuda"
        self._host_codes = torch.empty((2, pairs, contract.NUM_CODEBOOKS), dtype=torch.int64, pin_memory=pinned)
        self._host_ended = torch.empty((2, pairs), dtype=torch.bool, pin_memory=pinned)
        self._in_flight: InFlightStep | None = None
        # Songs whose prefill failed, until step() returns them (kept here: the same step may raise afterwards).
        self._failed: list[SongFailed] = []
        self.waiting: deque[TalkerSong] = deque()
        self.active: list[TalkerSong] = []  # song in pair p is active[p]
        self.songs: dict[str, TalkerSong] = {}
        self.frames_written = 0  # by every song, those cancelled or failed later included

    @torch.inference_mode()
    def warm_prefill(self) -> None:
        """Compile the fused hot paths and kernels for prefill shapes (several tokens per row) now, not in the first
        request.

        Writes a first chunk of ROW_TILE tokens a row (causal attention) and a later one of one token (attention over
        the cache before it, without a mask) into pair 0's KV rows, which any admission overwrites from position 0
        before they can be read. The first chunk's 2 * ROW_TILE rows run the skinny GEMM's tiles of more than ROW_TILE
        rows, as prompts of ROW_TILE / 2 + 1 to skinny_linear.MAX_ROWS / 2 tokens a row do."""
        first_chunk = min(ROW_TILE, self.config.max_model_len - 1)
        for start, tokens in ((0, first_chunk), (first_chunk, 1)):
            if not tokens:  # a context of one position: the one-token chunk alone
                continue
            ids = torch.zeros(2, tokens, dtype=torch.int64, device=self.device)
            positions = torch.arange(start, start + tokens, device=self.device)
            self.lm(self.lm.embed(ids), positions, self.slots.prefill(0, start))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _mix(self, conditioning: torch.Tensor) -> torch.Tensor:
        return self.encoder.mix(conditioning.float())

    def submit(self, song: str, cond_ids: list[int], uncond_ids: list[int], seed: int, requested_frames: int) -> int:
        """Queue a song; returns its frame budget, fixed now."""
        if song in self.songs:
            raise InputError(f"song id {song!r} is already in use")
        self.songs[song] = new_song(song, cond_ids, uncond_ids, seed, requested_frames, self.lm.cfg.vocab,
                                    self.config.max_model_len, self.device)
        self.waiting.append(self.songs[song])
        return self.songs[song].budget

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active or self._in_flight or self._failed)

    def cancel(self, song: str) -> bool:
        """Drop a song wherever it is; its rows are free for the next step. False if unknown."""
        state = self.songs.pop(song, None)
        if state is None:
            return False
        if state in self.waiting:
            self.waiting.remove(state)
        else:
            with self._on_stream():  # behind the step in flight, which still advances the rows being moved
                self._release(state)
        return True

    def cancel_all(self) -> None:
        """Drop every song and the step in flight, whose results nobody will read (the engine is closing)."""
        for song in list(self.songs):
            self.cancel(song)
        self._in_flight, self._failed = None, []

    def _on_stream(self) -> contextlib.AbstractContextManager:
        """Run on the talker's stream, after whatever the caller queued on its own."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream all stage-0 work runs on (None on the CPU)."""
        return self.step_fn.stream

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """One scheduler iteration: prefill within the token budget, queue one frame for all decoding songs, then
        read back the previous iteration's frame while the device computes this one. Events therefore trail the
        device by one step; a song that ends has had one more step queued, whose results are dropped. Each
        WindowReady's `ready` event marks when its conditioning is written."""
        with self._on_stream():  # prompts the caller queued on its own stream come first
            self._prefill()
            previous, self._in_flight = self._in_flight, self._launch() if self.active else None
            events = self._collect(previous) if previous is not None else []
        if self._failed:  # prefill failures first, as they happened first
            events, self._failed = [*self._failed, *events], []
        return events

    def _prefill(self) -> None:
        """Prefill waiting songs in order, each in chunks of max_num_batched_tokens // 2 tokens a row (its last one
        shorter): a song's chunks, hence its rounding, never depend on what else is prefilled in the same step. A chunk
        that does not fit in what the step has left waits for the next step."""
        tokens = self.config.max_num_batched_tokens
        while self.waiting and len(self.active) < self.slots.pairs:
            song = self.waiting[0]
            chunk = min(song.ids.shape[1] - song.prefilled, self.config.max_num_batched_tokens // 2)
            if 2 * chunk > tokens:
                break
            try:
                tokens -= 2 * self._prefill_chunk(song, chunk)
            except Exception as exc:  # say out of memory for its prompt: this song fails, the others go on
                log.exception("talker prefill failed", extra={"song": song.id})
                self.waiting.popleft()
                del self.songs[song.id]
                self._failed.append(SongFailed(song.id, f"stage 0 could not prefill the song: {exc}"))

    def _prefill_chunk(self, song: TalkerSong, limit: int) -> int:
        """Prefill up to `limit` more prompt tokens of the song at the head of the queue, in both rows; once its
        whole prompt is in, it leaves the queue and decodes. Returns the tokens prefilled per row."""
        if song.pair is not None and song.pair != len(self.active):  # pairs were packed since its last chunk
            self.slots.move_pair(song.pair, len(self.active), song.prefilled)
        song.pair = len(self.active)
        total = song.ids.shape[1]
        chunk = min(total - song.prefilled, limit)
        ids = song.ids[:, song.prefilled : song.prefilled + chunk]
        positions = torch.arange(song.prefilled, song.prefilled + chunk, device=self.device)
        hidden = self.lm(self.lm.embed(ids), positions, self.slots.prefill(song.pair, song.prefilled))
        song.prefilled += chunk
        if song.prefilled == total:
            self._activate(song, hidden[:, -1])
            self.waiting.popleft()
        return chunk

    def _activate(self, song: TalkerSong, hidden: torch.Tensor) -> None:
        p, step = song.pair, self.step_fn
        # First the allocation that can fail: the pair's step buffers are left idle if it does.
        song.conditioning = torch.empty(song.budget + 1, self.lm.cfg.hidden, dtype=torch.float32, device=self.device)
        step.hidden[2 * p : 2 * p + 2] = hidden
        step.positions[2 * p : 2 * p + 2] = song.ids.shape[1]
        step.seeds[p], step.frames[p] = as_int64(song.seed), 0
        self.active.append(song)

    def _launch(self) -> InFlightStep:
        """Queue one frame step for every active song and the copies of its results."""
        step, count = self.step_fn, len(self.active)
        buffer = 0 if self._in_flight is None else 1 - self._in_flight.buffer
        step(2 * count)
        # Each song's frame conditioning goes to its next slot (one multi-tensor copy kernel, queued behind the
        # step). Step s writes slot max(s - 1, 0): step 0's frame is not kept, so step 1 writes slot 0 again.
        slots = [song.conditioning[max(song.launched - 1, 0)] for song in self.active]
        torch._foreach_copy_(slots, list(step.mixed[:count]))
        self._host_codes[buffer, :count].copy_(step.codes[:count], non_blocking=True)
        self._host_ended[buffer, :count].copy_(step.ended[:count], non_blocking=True)
        copied = torch.cuda.Event() if self.stream is not None else None
        if copied is not None:
            copied.record()
        for song in self.active:
            song.launched += 1
        return InFlightStep(list(self.active), buffer, copied)

    def _collect(self, done: InFlightStep) -> list[Event]:
        """Read back a queued step's codes and audio_end flags; emit the windows it completed and the songs it
        ended. Songs cancelled or finished since it was queued are skipped."""
        if done.copied is not None:
            done.copied.synchronize()
        count = len(done.songs)
        codes, ended = self._host_codes[done.buffer, :count].clone(), self._host_ended[done.buffer, :count].clone()
        events: list[Event] = []
        finished: list[TalkerSong] = []
        for p, song in enumerate(done.songs):
            if self.songs.get(song.id) is not song:
                continue
            index, song.steps = song.steps, song.steps + 1
            if bool(ended[p]):
                finished.append(song)
                events += self._finish(song, "audio_end", done.copied)
            elif index > 0:
                song.codes.append(codes[p])
                self.frames_written += 1
                events += [song.window_ready(w, done.copied) for w in song.windows.ready(song.frames)]
                if song.frames == song.budget:
                    finished.append(song)
                    events += self._finish(song, "budget", done.copied)
        for song in finished:
            self.songs.pop(song.id, None)
            self._release(song)
        return events

    def _finish(self, song: TalkerSong, ended_by: str, ready: torch.cuda.Event | None) -> list[Event]:
        if not song.frames:
            return [SongFailed(song.id, "the model ended the song before its first frame (audio_end drawn at once)")]
        log.info("talker song done", extra={"song": song.id, "frames": song.frames, "ended_by": ended_by})
        windows = [song.window_ready(w, ready) for w in song.windows.finish(song.frames)]
        return [*windows, SongFinished(song.id, song.frames, ended_by, torch.stack(song.codes))]

    def _release(self, song: TalkerSong) -> None:
        """Free the song's pair; the last active pair moves into the gap so active pairs stay packed."""
        if song.pair is None or song not in self.active:
            return
        step, gap, last = self.step_fn, song.pair, len(self.active) - 1
        if gap != last:
            moved = self.active[last]
            filled = moved.ids.shape[1] + moved.launched  # KV rows written, the queued step included
            self.slots.move_pair(last, gap, min(filled, self.slots.scratch))
            for buffer in (step.hidden, step.positions):
                buffer[2 * gap : 2 * gap + 2] = buffer[2 * last : 2 * last + 2]
            step.seeds[gap], step.frames[gap] = step.seeds[last], step.frames[last]
            self.active[gap], moved.pair = moved, gap
        self.active.pop()
        step.positions[2 * last : 2 * last + 2] = self.slots.scratch
        step.hidden[2 * last : 2 * last + 2] = 0
        song.pair = None
