"""Stage 1 for many songs at once: ready windows batched by latent length, the overlap carry per song, PCM out.

A window of a song can be rendered once the previous one is done (it needs that window's carry), so a call takes
at most one window per song; windows of different songs with the same latent length share one DiT batch (cond and
uncond rows of every window in the same call) and one vocoder batch. Not thread-safe: one caller at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from typing import Any

import torch
from tqdm.auto import tqdm

from .. import contract
from ..errors import NonFiniteAudio
from ..kernels import glu_linear
from ..models.condition_encoder import ConditionEncoder
from ..models.dit import DiT
from ..models.fp8 import Fp8Weight
from ..models.fusion import enable_fusion, fusion_enabled
from ..models.vocoder import Vocoder
from .payloads import RenderedWindow, StreamedSong, WindowPayload, check_payloads, next_state
from .precision import FLOAT32, PrecisionPolicy, apply_policy, float32_matmuls
from .solver import FULL_LENGTH, WARMUP_STEPS, Carry, GraphedSolve, noise, solve
from .windows import crop_waveform, song_windows

log = logging.getLogger(__name__)

# A song's last window is shorter than a full one and runs outside the captured graphs. Warm-up also renders a
# window of this many frames, whose token count (the latent length plus the time token) divides by 16 where a full
# window's (690) does not: a kernel compiled per divisibility of its sizes meets both in warm-up, not while songs play.
# Our own Triton kernels take the token count unspecialised (kernels/dit_attention.py, kernels/split_rope.py).
SHORT_WARMUP_FRAMES = max(f for f in range(1, contract.WINDOW_FRAMES) if (contract.latent_length(f) + 1) % 16 == 0)


class Renderer:
    """Condition projection, 30 Euler steps with guidance, vocoder and crop for ready windows of many songs."""

    def __init__(
        self,
        condition_encoder: ConditionEncoder,
        dit: DiT,
        vocoder: Vocoder,
        policy: PrecisionPolicy = FLOAT32,
        graphs: bool = False,
        max_batch: int = 8,
        fuse: bool = False,
    ):
        apply_policy(condition_encoder, dit, vocoder, policy)  # casts the modules in place
        if fuse and dit.proj_in.weight.device.type == "cuda":
            enable_fusion()  # the DiT block's LayerNorms, GLU and residual adds fused around the GEMMs (process-wide)
        self.encoder, self.dit, self.vocoder, self.policy = condition_encoder, dit, vocoder, policy
        self.device = dit.proj_in.weight.device
        self.graphs = graphs and self.device.type == "cuda"  # unused on the CPU
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # all stage-1 work
        self.max_batch = max_batch
        if self.device.type == "cuda" and dit.blocks and dit.blocks[0].glu_pairs:
            log_feed_forward_gate(dit.blocks[0].ff_in.weight)
        self._songs: dict[Hashable, StreamedSong] = {}
        self._graphed: dict[tuple[int, int], GraphedSolve] = {}
        self._pool = None

    @classmethod
    def from_models(cls, models: Any, policy: PrecisionPolicy = FLOAT32, **kwargs: Any) -> "Renderer":
        return cls(models.condition_encoder, models.dit, models.vocoder, policy, **kwargs)

    # Song state.
    def next_index(self, song: Hashable) -> int:
        """Index of the window this song needs next (0 for a song the renderer holds nothing for)."""
        state = self._songs.get(song)
        return 0 if state is None else state.next_index

    @property
    def songs(self) -> list[Hashable]:
        return list(self._songs)

    def cancel(self, song: Hashable) -> None:
        """Forget a song whose request went away; a later window 0 with this id starts afresh."""
        self._songs.pop(song, None)

    # Inputs.
    @torch.inference_mode()
    def mix(self, conditioning: torch.Tensor) -> torch.Tensor:
        """[frames, streams * hidden] talker conditioning -> mixed [frames, hidden] on this renderer's device."""
        return self.encoder.mix(conditioning.to(self.device, self.encoder.proj.weight.dtype))

    def payloads(self, song: Hashable, seed: int, mixed: torch.Tensor, steps: int = contract.DIT_STEPS):
        """The windows of a whole song's mixed conditioning [frames, hidden], in order."""
        return [
            WindowPayload(song, seed, w, mixed[w.start : w.start + w.frames], steps) for w in song_windows(mixed.shape[0])
        ]

    # Rendering.
    @torch.inference_mode()
    def render(self, payloads: list[WindowPayload]) -> list[RenderedWindow]:
        """Render ready windows (at most one per song, each the song's next); results in the payloads' order. A call
        that raises leaves every song as it was: the same windows may be rendered again."""
        if self.stream is None:
            return self._render(payloads)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs the caller's stream produced
        with torch.cuda.stream(self.stream):
            return self._render(payloads)

    def _render(self, payloads: list[WindowPayload]) -> list[RenderedWindow]:
        check_payloads(payloads, self._songs, self.encoder.cfg.hidden)
        carries = [self._songs[p.song].carry if p.song in self._songs else None for p in payloads]
        latents: list[torch.Tensor] = [None] * len(payloads)  # type: ignore[list-item]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, p in enumerate(payloads):
            groups.setdefault((p.window.latent_length, p.steps), []).append(i)
        with float32_matmuls(self.device):
            conditions = [self._condition(p, c) for p, c in zip(payloads, carries)]
            for (length, steps), members in groups.items():
                for chunk in _chunks(members, self.max_batch):
                    initial = [noise(payloads[i].seed, payloads[i].window.index, length) for i in chunk]
                    args = [conditions[i] for i in chunk], initial, [carries[i] for i in chunk]
                    # Only graphs captured at warm-up replay: capturing while serving would stall the other stage.
                    graphed = self._graphed.get((len(chunk), steps)) if length == FULL_LENGTH else None
                    out = graphed(*args) if graphed else solve(self.dit, *args, steps)
                    for i, latent in zip(chunk, out):
                        latents[i] = latent
        waves = self.vocode(latents)
        crops = [crop_waveform(wave, p.window) for p, wave in zip(payloads, waves)]
        for p, crop in zip(payloads, crops):  # checked before the clamp, which would turn infinities into full scale
            if not torch.isfinite(crop).all():  # NaN would reach the listener as clicks (int16 of NaN): a failure
                raise NonFiniteAudio(f"window {p.window.index} of song {p.song!r} rendered to non-finite audio")
        results = [
            RenderedWindow(p.song, p.window, crop.clamp(-1.0, 1.0).cpu(), latent.float().cpu())
            for p, latent, crop in zip(payloads, latents, crops)
        ]
        # The songs move on only once every window of the call is done.
        states = [next_state(p, latent, condition) for p, latent, condition in zip(payloads, latents, conditions)]
        for p, state in zip(payloads, states):
            if state is None:
                self._songs.pop(p.song, None)
            else:
                self._songs[p.song] = state
        return results

    def _condition(self, payload: WindowPayload, carry: Carry | None) -> torch.Tensor:
        """The window's condition [latent_length, dim] in float32, its first columns the carried ones."""
        condition = self.encoder.project(payload.mixed[None].to(self.device))[0].float()
        if carry is not None:
            overlap = min(carry.latent.shape[-1], condition.shape[0])
            condition[:overlap] = carry.condition[:overlap]
        return condition

    @torch.inference_mode()
    def vocode(self, latents: list[torch.Tensor]) -> list[torch.Tensor]:
        """Uncropped float32 waveforms [2, samples] of latents [channels, length], batched by equal length."""
        waves: list[torch.Tensor] = [None] * len(latents)  # type: ignore[list-item]
        groups: dict[int, list[int]] = {}
        for i, latent in enumerate(latents):
            groups.setdefault(latent.shape[-1], []).append(i)
        dtype = self.vocoder.conv_in.weight.dtype
        with float32_matmuls(self.device, conv_tf32=self.policy.vocoder_tf32):
            for members in groups.values():
                for chunk in _chunks(members, self.max_batch):
                    batch = torch.stack([latents[i] for i in chunk]).to(self.device, dtype)
                    for i, wave in zip(chunk, self.vocoder(batch).float()):
                        waves[i] = wave
        return waves

    def _graph(self, batch: int, steps: int) -> GraphedSolve:
        key = (batch, steps)
        if key not in self._graphed:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            self._graphed[key] = GraphedSolve(self.dit, batch, steps, self.stream, self._pool)
        return self._graphed[key]

    @torch.inference_mode()
    def warmup(self, batches: Iterable[int], steps: int = contract.DIT_STEPS, render_one: bool | None = None) -> None:
        """Capture the full-window graphs of `steps` Euler steps for these batch sizes (each after one eager step, not
        a whole solve), then render throwaway windows of one step (render_one; by default on CUDA, or where fusion is
        on), one alone and two at once, then a short one (SHORT_WARMUP_FRAMES): inductor's compiles of the fused
        functions (a DiT call of two windows or more takes the fused gate of kernels/glu_linear.py, compiled on first
        use), Triton's, the eager solve (without graphs), the vocoder's first calls and lazy inits happen now, not in
        the first songs' windows."""
        if self.graphs:
            with float32_matmuls(self.device):
                for batch in sorted(set(batches), reverse=True):
                    self._graph(min(batch, self.max_batch), steps)
        if render_one is None:  # on the CPU too where a caller enabled fusion: its compiles happen now
            render_one = self.device.type == "cuda" or fusion_enabled()
        if render_one:
            (window,) = song_windows(contract.WINDOW_FRAMES)
            mixed = torch.zeros(window.frames, self.encoder.cfg.hidden, device=self.device)
            for batch in sorted({1, min(2, self.max_batch)}):  # each song's only window: no state is kept
                self.render([WindowPayload(object(), 0, window, mixed, WARMUP_STEPS) for _ in range(batch)])
            (short,) = song_windows(SHORT_WARMUP_FRAMES)
            self.render([WindowPayload(object(), 0, short, mixed[: short.frames], WARMUP_STEPS)])

    def render_song(
        self, mixed: torch.Tensor, seed: int, steps: int = contract.DIT_STEPS, song: Hashable | None = None,
        progress: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A whole song offline, window after window: waveform [2, samples] on the CPU and each window's latent."""
        song = _OfflineSong() if song is None else song
        if song in self._songs:  # its windows would be refused as out of order, and the cancel below drop its state
            raise ValueError(f"song {song!r} is streaming on this renderer: render it offline under another id")
        pieces, latents = [], []
        try:
            for payload in tqdm(self.payloads(song, seed, mixed, steps), desc="windows", unit="window",
                                disable=not progress):
                (out,) = self.render([payload])
                pieces.append(out.pcm)
                latents.append(out.latent)
        finally:
            self.cancel(song)
        return torch.cat(pieces, dim=-1), latents


def log_feed_forward_gate(weight: torch.Tensor | Fp8Weight) -> None:
    """Say at start whether the DiT's feed-forward gate runs in quack's GEMM (kernels/glu_linear.py), or why not on a
    Hopper GPU, where the `hopper` extra would make multi-window DiT calls faster. FP8 weights: the gate is always
    the pass after the FP8 GEMM, nothing to say."""
    if isinstance(weight, Fp8Weight):
        return
    reason = glu_linear.unavailable_reason(weight)
    if reason is None:
        log.info("stage 1 fuses the DiT's feed-forward gate into quack's GEMM",
                 extra={"from_rows": glu_linear.MIN_ROWS})
    elif reason != "not a Hopper GPU":
        log.warning("stage 1 runs the DiT's feed-forward gate as a separate pass, 6-8% slower per DiT call of two "
                    "windows or more", extra={"reason": reason})


class _OfflineSong:
    """The key of a song rendered offline without an id: unique to its call, and named so in error messages."""

    def __repr__(self) -> str:
        return "<offline song>"


def _chunks(items: list[int], size: int) -> Iterable[list[int]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
