"""The deploy configuration as typed frozen dataclasses, with the defaults a missing YAML key takes.

`default_deploy.yaml` spells these defaults out in full; docs/configuration.md describes every key. Reading and
validating the YAML into these classes: :mod:`.deploy_config`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import contract

if TYPE_CHECKING:
    from ..talker.config import TalkerConfig

PIPELINE = "minimax_music3"
CONNECTOR = "connector_of_shared_memory"  # the default connector's name
MIN_STAGE0_MAX_TOKENS = contract.MAX_FRAMES + 1  # steps of the longest song: the first sampled frame is not emitted
SEED_LIMIT = contract.SEED_LIMIT
MAX_WINDOWS = len(contract.window_starts(contract.MAX_FRAMES))  # windows of the longest song: 89
# Sanity bounds on integers that size memory, lists or waits; far past any card (1024 full-context rows are 1.5 TB
# of KV), they keep a typo such as an extra zero from building huge lists or overflowing a float.
MAX_NUM_SEQS = 1024  # stage 0 rows, stage 1 songs per render call
MAX_NUM_BATCHED_TOKENS = MAX_NUM_SEQS * contract.MAX_CONTEXT  # every row prefilling a whole context in one step
MAX_GPU_INDEX = 1023
MAX_WAIT_MS = 24 * 3600 * 1000  # a day
# The reader's poll wakes as soon as a payload arrives; the interval only sets how often it checks its deadline and
# whether the connector was closed. Shorter than 0.1 ms, that check turns into a busy loop holding a CPU core.
MIN_SLEEP_S = 1e-4


@dataclass(frozen=True)
class SharedMemoryExtra:
    codec_streaming: bool = True  # PCM goes to the client window by window, else as one piece at the end
    shm_threshold_bytes: int = 65536  # payloads of this size or more travel in shared memory, smaller ones inline
    connector_get_sleep_s: float = 0.01  # poll interval of a reader waiting for its next payload
    connector_get_max_wait_first_chunk_ms: int = 30000  # wait for a song's first window/chunk, then fail the song
    connector_get_max_wait_ms: int = 10000  # wait for each later one

    @property
    def first_chunk_timeout_s(self) -> float:
        """The wait for a song's first chunk (it also covers stage 0's prefill), in seconds."""
        return self.connector_get_max_wait_first_chunk_ms / 1000.0

    @property
    def timeout_s(self) -> float:
        """The wait for each later chunk, in seconds."""
        return self.connector_get_max_wait_ms / 1000.0

    def as_extra(self) -> dict[str, Any]:
        """The `extra` block under its YAML key names (waits in milliseconds)."""
        return {
            "codec_streaming": self.codec_streaming,
            "shm_threshold_bytes": self.shm_threshold_bytes,
            "connector_get_sleep_s": self.connector_get_sleep_s,
            "connector_get_max_wait_first_chunk": self.connector_get_max_wait_first_chunk_ms,
            "connector_get_max_wait": self.connector_get_max_wait_ms,
        }


@dataclass(frozen=True)
class ConnectorConfig:
    name: str = "SharedMemoryConnector"
    extra: SharedMemoryExtra = field(default_factory=SharedMemoryExtra)


@dataclass(frozen=True)
class CompilationConfig:
    mode: int = 0  # 0 = no compilation, the only mode this engine runs
    cudagraph_capture_sizes: tuple[int, ...] = (2, 4, 8, 16)
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    cudagraph_num_of_warmups: int = 1
    custom_ops: tuple[str, ...] = ("all",)


@dataclass(frozen=True)
class CfgArgs:
    cfg_role: str = "cond"
    cfg_scale: float = contract.AR_CFG_SCALE


@dataclass(frozen=True)
class Stage0Sampling:
    temperature: float = 1.0
    max_tokens: int = MIN_STAGE0_MAX_TOKENS
    seed: int | None = None  # song seed of requests that bring none; None: a fresh random seed per request
    extra_args: CfgArgs = field(default_factory=CfgArgs)


@dataclass(frozen=True)
class Stage1Sampling:
    temperature: float = 0.0
    max_tokens: int = MAX_WINDOWS
    seed: int = 0  # the only value: stage 1 draws nothing at temperature 0, its DiT noise is keyed by the song's seed


QUANTIZATIONS = ("none", "fp8")  # a stage's `quantization`: none, or e4m3 weights (models/fp8.py)


def describe_precision(dtype: str, quantization: str, talker: bool) -> str:
    """One stage's precision and what it costs, in words (the start-up log line of `generate` and `serve`)."""
    if quantization == "fp8":
        if talker:
            return f"fp8: e4m3 weights with per-channel scales (half the weight memory), {dtype} activations and KV"
        overridden = f"; dtype {dtype} is overridden" if dtype != "bfloat16" else ""
        return f"fp8: the DiT blocks' GEMMs in e4m3, the rest as bfloat16 (bf16 activations{overridden})"
    if not talker and dtype == "float32":
        return ("float32: the reference, about 5x slower than bfloat16 on a GPU (H200: a 20 s song in 24.0 s against "
                "4.8 s, first audio after 6.6 s against 1.8 s; docs/performance.md, docs/precision.md)")
    return dtype


def precision_log_level(stage1: str, device_type: str) -> int:
    """The level of the start-up precision line: a warning where stage 1 runs float32 on a GPU, the slow path."""
    return logging.WARNING if stage1 == "float32" and device_type == "cuda" else logging.INFO


class _Stage:
    """What both stage dataclasses compute from their fields."""

    enforce_eager: bool
    compilation_config: CompilationConfig
    dtype: str
    quantization: str

    @property
    def graphs(self) -> bool:
        """Whether the stage captures CUDA graphs: not eager, and a graph mode other than NONE."""
        return not self.enforce_eager and self.compilation_config.cudagraph_mode != "NONE"


@dataclass(frozen=True)
class Stage0Config(_Stage):
    """The talker. Rows, not songs: every song is a cond/uncond pair of rows."""

    stage_id: int = 0
    max_num_seqs: int = 16
    gpu_memory_utilization: float = 0.6
    dtype: str = "bfloat16"
    quantization: str = "none"  # fp8: e4m3 weights of the backbone, its head and the depth decoder; bf16 activations
    max_model_len: int = contract.MAX_CONTEXT
    max_num_batched_tokens: int = contract.MAX_CONTEXT
    enforce_eager: bool = False
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    async_scheduling: bool = False
    enable_prefix_caching: bool = False
    devices: tuple[int, ...] = (0,)
    output_connectors: dict[str, str] = field(default_factory=lambda: {"to_stage_1": CONNECTOR})
    default_sampling_params: Stage0Sampling = field(default_factory=Stage0Sampling)


@dataclass(frozen=True)
class Stage1Config(_Stage):
    """The acoustic decoder. One row per song; its "tokens" are windows (one per 100-frame hop)."""

    stage_id: int = 1
    max_num_seqs: int = 8
    gpu_memory_utilization: float = 0.2
    dtype: str = "float32"
    quantization: str = "none"  # fp8: the DiT blocks' linear layers in e4m3 (weights and activations), dtype bf16
    max_model_len: int = MAX_WINDOWS
    max_num_batched_tokens: int = 8
    enforce_eager: bool = False
    compilation_config: CompilationConfig = field(
        default_factory=lambda: CompilationConfig(cudagraph_capture_sizes=tuple(range(1, 9)))  # window batches, not rows
    )
    async_scheduling: bool = False
    enable_prefix_caching: bool = False
    devices: tuple[int, ...] = (0,)
    input_connectors: dict[str, str] = field(default_factory=lambda: {"from_stage_0": CONNECTOR})
    default_sampling_params: Stage1Sampling = field(default_factory=Stage1Sampling)

    @property
    def precision(self) -> str:
        """The precision policy's name (acoustic/precision.py): fp8 when quantized (bf16 around it), else dtype."""
        return "fp8" if self.quantization == "fp8" else self.dtype

    @property
    def render_batch(self) -> int:
        """Windows one render call takes: one per song, at most max_num_batched_tokens."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)


@dataclass(frozen=True)
class DeployConfig:
    pipeline: str = PIPELINE
    async_chunk: bool = True
    trust_remote_code: bool = False
    connectors: dict[str, ConnectorConfig] = field(default_factory=lambda: {CONNECTOR: ConnectorConfig()})
    stages: tuple[Stage0Config, Stage1Config] = field(default_factory=lambda: (Stage0Config(), Stage1Config()))
    source: str = field(default="<defaults>", compare=False)

    @property
    def connector(self) -> ConnectorConfig:
        """The connector between the stages in the split layout (windows to the stage-1 worker, its PCM and events
        back)."""
        return self.connectors[self.stages[0].output_connectors["to_stage_1"]]

    def precisions(self, talker_dtype: str | None = None) -> dict[str, str]:
        """What each stage runs in, as the engine says at start; `talker_dtype`: its weights' dtype where they are
        loaded (the CPU runs the talker in float32, whatever the file says)."""
        s0, s1 = self.stages
        held = talker_dtype or s0.dtype
        talker = describe_precision(held, s0.quantization, talker=True)
        if s0.quantization == "none" and held != s0.dtype:
            talker = f"{held} (on this device; the deploy file's {s0.dtype} applies on GPUs)"
        return {"stage 0": talker, "stage 1": describe_precision(s1.dtype, s1.quantization, talker=False)}

    def talker_config(self) -> TalkerConfig:
        """Stage 0 as the talker engine's settings. Capture sizes count rows, so only even ones are kept."""
        from ..talker.config import TalkerConfig

        s0 = self.stages[0]
        sizes = tuple(sorted({s for s in s0.compilation_config.cudagraph_capture_sizes if s % 2 == 0}))
        return TalkerConfig(
            max_num_seqs=s0.max_num_seqs,
            max_model_len=s0.max_model_len,
            max_num_batched_tokens=s0.max_num_batched_tokens,
            capture_sizes=sizes,
            enforce_eager=not s0.graphs,
            gpu_memory_utilization=s0.gpu_memory_utilization,
        )

