"""The engine's start in this process: stage 1's weights in their precision, the talker (in FP8 if asked) with its
graphs, then stage 1's renderer warmed up (colocated); the seconds each stage took."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..acoustic.precision import PrecisionPolicy, apply_policy
from ..acoustic.renderer import Renderer
from ..checkpoint import Music3Models
from ..talker.engine import Talker
from ..talker.quantize import quantize_talker
from .deploy_config import DeployConfig
from .render_loop import stage1_renderer


@dataclass(frozen=True)
class StartedStages:
    talker: Talker
    renderer: Renderer | None  # colocated only: a split engine's renders in its worker
    ready_s: dict[str, float]  # seconds from loaded weights to ready, per stage started here


def start_stages(models: Music3Models, deploy: DeployConfig, colocated: bool) -> StartedStages:
    started = time.perf_counter()
    if colocated:  # stage 1's weights in their precision first: the float32 copies are gone before the KV
        apply_policy(models.condition_encoder, models.dit, models.vocoder,
                     PrecisionPolicy.named(deploy.stages[1].precision))
    policy_s, started = time.perf_counter() - started, time.perf_counter()  # stage 1's part, before the talker's
    if deploy.stages[0].quantization == "fp8":
        quantize_talker(models.language_model, models.depth_decoder)
    talker = Talker(models.language_model, models.depth_decoder, models.condition_encoder, deploy.talker_config())
    talker_ready = time.perf_counter()
    ready_s = {"talker": talker_ready - started}
    renderer = stage1_renderer(models, deploy.stages[1]) if colocated else None
    if colocated:
        ready_s["renderer"] = policy_s + time.perf_counter() - talker_ready
    return StartedStages(talker, renderer, ready_s)
