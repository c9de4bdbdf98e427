"""Offline generation: prompt -> talker frames -> windows rendered and vocoded -> 44.1 kHz stereo waveform."""

from __future__ import annotations

import logging
import time
from functools import cached_property
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from . import contract
from .acoustic.precision import PrecisionPolicy
from .acoustic.renderer import Renderer
from .checkpoint import Music3Models, load_models
from .errors import InputError
from .hashing import as_int64
from .models.language_model import KVCache
from .prompt import check_seed, check_steps, encode_prompt, frames_for_duration, warn_dropped_lyrics
from .serving.deploy_schema import describe_precision, precision_log_level
from .talker.frame import talker_frame

log = logging.getLogger(__name__)


@dataclass
class Song:
    waveform: np.ndarray  # [2, samples] float32 in [-1, 1]
    sample_rate: int
    codes: torch.Tensor  # [frames, 8]
    ended_by: str  # "audio_end" or "budget"
    budget: int  # frames the song was allowed
    timings: dict[str, float] = field(default_factory=dict)
    conditioning: torch.Tensor | None = None  # [frames, 8 * hidden], kept when trace=True
    latents: list[torch.Tensor] | None = None  # per-window latents, kept when trace=True

    @property
    def frames(self) -> int:
        return self.codes.shape[0]


class Pipeline:
    """Both stages in one process; the reference recipe step by step, batch of one song."""

    def __init__(self, models: Music3Models, acoustic: str = "float32"):
        """`acoustic` is the stage-1 precision policy; the acoustic modules are cast to it in place."""
        self.models, self.acoustic = models, acoustic

    @cached_property
    def renderer(self) -> Renderer:
        return Renderer.from_models(self.models, PrecisionPolicy.named(self.acoustic))

    @classmethod
    def from_pretrained(
        cls, root: Path | str, device: str = "cpu", talker_dtype: torch.dtype | None = None, acoustic: str = "float32",
        progress: bool = False, quantization: str = "none",
    ) -> "Pipeline":
        """Load a checkpoint; acoustic modules load in float32 so a bf16 policy keeps true float32 islands.
        quantization "fp8": the talker's weights in e4m3 and stage 1 on the fp8 policy (whatever `acoustic` says)."""
        models = load_models(Path(root), device=device, talker_dtype=talker_dtype, progress=progress,
                             quantization=quantization)
        precisions = {"stage 0": describe_precision(str(models.language_model.embed.weight.dtype).removeprefix(
            "torch."), quantization, talker=True), "stage 1": describe_precision(acoustic, quantization, talker=False)}
        policy = "fp8" if quantization == "fp8" else acoustic
        log.log(precision_log_level(policy, torch.device(device).type), "stage precision", extra=precisions)
        return cls(models, policy)

    @property
    def device(self) -> torch.device:
        return self.models.language_model.embed.weight.device

    @torch.inference_mode()
    def generate(
        self,
        caption: str,
        lyrics: str,
        duration: float,
        seed: int,
        steps: int = contract.DIT_STEPS,
        progress: bool = False,
        trace: bool = False,
    ) -> Song:
        requested, seed, steps = frames_for_duration(duration), check_seed(seed), check_steps(steps)
        cond_ids, uncond_ids = encode_prompt(self.models.tokenizer, caption, lyrics)
        warn_dropped_lyrics(lyrics)
        budget = contract.frame_budget(requested, len(cond_ids))
        started = time.perf_counter()
        codes, conditioning, ended_by = self.talk(cond_ids, uncond_ids, budget, seed, progress)
        talked = time.perf_counter()
        waveform, latents = self.render(conditioning, seed, steps, progress)
        timings = {"talker_s": talked - started, "acoustic_s": time.perf_counter() - talked}
        log.info("song done", extra={"frames": codes.shape[0], "ended_by": ended_by, **timings})
        return Song(
            waveform=waveform.numpy(),
            sample_rate=contract.SAMPLE_RATE,
            codes=codes,
            ended_by=ended_by,
            budget=budget,
            timings=timings,
            conditioning=conditioning if trace else None,
            latents=latents if trace else None,
        )

    def talk(
        self, cond_ids: list[int], uncond_ids: list[int], budget: int, seed: int, progress: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, str]:
        """Stage 0 for one song: codes [frames, 8], frame conditioning [frames, 8 * hidden], why it stopped."""
        lm, depth = self.models.language_model, self.models.depth_decoder
        ids = torch.tensor([cond_ids, uncond_ids], device=self.device)
        cache = KVCache.allocate(lm.cfg, 2, ids.shape[1] + budget, lm.embed.weight.dtype, self.device)
        hidden = lm(lm.embed(ids), torch.arange(ids.shape[1], device=self.device), cache.at(0))[:, -1]
        position = ids.shape[1]
        seeds = torch.tensor([as_int64(seed)], device=self.device)
        codes, conditioning, ended_by = [], [], "budget"
        # Step 0 only moves past <|audio_start|>: its frame is fed back but not emitted.
        with tqdm(total=budget, desc="frames", unit="frame", disable=not progress) as bar:
            for step in range(budget + 1):
                # Depth calls recompute their sequence, as the reference does; the engine's cached calls (its default)
                # give the same codes on the CPU (tests/test_talker_engine.py) and may round differently on a GPU.
                frames = torch.tensor([step], device=self.device)
                frame = talker_frame(lm, depth, hidden, seeds, frames, depth_cache=False)
                if bool(frame.ended[0]):
                    ended_by = "audio_end"
                    break
                if step > 0:
                    codes.append(frame.codes[0])
                    conditioning.append(frame.conditioning[0])
                    bar.update()
                    if len(codes) == budget:
                        break
                at = torch.tensor([position], device=self.device)
                hidden = lm(frame.feedback[:, None], at, cache.at(position))[:, -1]
                position += 1
        if not codes:
            raise InputError("the model ended the song before its first frame (audio_end drawn at once)")
        return torch.stack(codes).cpu(), torch.stack(conditioning), ended_by

    def render(
        self, conditioning: torch.Tensor, seed: int, steps: int = contract.DIT_STEPS, progress: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Stage 1 for one song, window after window: waveform [2, samples] on the CPU and each window's latent."""
        mixed = self.renderer.mix(conditioning)
        return self.renderer.render_song(mixed, seed, steps, progress=progress)
