"""The two stages' blocks of the deploy YAML: stage 0 (the talker) and stage 1 (the acoustic decoder), each read
into its config with the keys both share, its device, its connector edge and its default sampling parameters."""

from __future__ import annotations

import re
from typing import Any

from .. import contract
from .deploy_compilation import parse_compilation
from .deploy_errors import quote
from .deploy_schema import (
    CONNECTOR,
    MAX_GPU_INDEX,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    MIN_STAGE0_MAX_TOKENS,
    QUANTIZATIONS,
    CfgArgs,
    ConnectorConfig,
    Stage0Config,
    Stage0Sampling,
    Stage1Config,
    Stage1Sampling,
)
from .deploy_section import Section, is_int

STAGE0_DTYPES = ("bfloat16", "float32")
STAGE1_DTYPES = ("float32", "bfloat16")
MIN_CONTEXT = contract.MIN_PROMPT_TOKENS + 1  # stage 0's max_model_len: a shorter one could serve no song
STAGE_KEYS = ("stage_id", "max_num_seqs", "gpu_memory_utilization", "dtype", "quantization", "max_model_len",
              "max_num_batched_tokens", "enforce_eager", "compilation_config", "async_scheduling", "enable_prefix_caching", "devices")
STAGE_EXTRA = ((0, ("output_connectors", "default_sampling_params")),
               (1, ("input_connectors", "default_sampling_params")))

# Why each stage refuses async_scheduling and enable_prefix_caching, by stage_id.
_SYNC_WHY = (
    "steps here are synchronous: a song's cond/uncond pair must be sampled inside one step (the guidance blend, and "
    "the code copied to both rows)",
    "steps here are synchronous: a window must be rendered, and its overlap carry handed to the song's next window, "
    "before that window is planned",
)
_PREFIX_WHY = (
    "KV lives in one static slot per song pair and is never shared; a cached uncond prefix would skew a pair's "
    "positions",
    "stage 1 has no KV cache: its tokens are windows, each rendered once from the talker's frames",
)
_QUANTIZATION_WHY = (
    "fp8: e4m3 weights with per-channel scales for the backbone, its head and the depth decoder; activations, KV "
    "and sampling stay in dtype",
    "fp8: the DiT blocks' linear layers in e4m3, weights per channel and activations per token; it runs the rest "
    "of stage 1 as dtype bfloat16 does, whatever dtype says",
)
_GPU_LIST = re.compile(r"\s*[0-9]+\s*(,\s*[0-9]+\s*)+")
_GPU = re.compile(r"\s*0*([0-9]{1,4})\s*")  # at most 4 digits past leading zeros: int() refuses over 4300


def _devices(m: Section, d: Stage0Config | Stage1Config) -> tuple[int]:
    """The stage's one GPU index; a bare integer reads as its digits."""
    devices = m.data.get("devices", ",".join(map(str, d.devices)))
    text = str(devices) if is_int(devices) and 0 <= devices <= MAX_GPU_INDEX else devices
    if isinstance(text, str) and _GPU_LIST.fullmatch(text):
        raise m.bad("devices", devices, "one GPU index (each stage runs on one GPU: no tensor or data parallelism)")
    match = _GPU.fullmatch(text) if isinstance(text, str) else None
    if not (match and int(match[1]) <= MAX_GPU_INDEX):
        raise m.bad("devices", devices, f'one GPU index in [0, {MAX_GPU_INDEX}] as a string, e.g. "0"')
    return (int(match[1]),)


def _common(m: Section, d: Stage0Config | Stage1Config, dtypes: tuple[str, ...], dtype_why: str) -> dict[str, Any]:
    return dict(
        gpu_memory_utilization=m.number("gpu_memory_utilization", d.gpu_memory_utilization, lambda v: 0 < v <= 1,
                                        "a number in (0, 1]"),
        dtype=m.choice("dtype", d.dtype, dtypes, dtype_why),
        quantization=m.choice("quantization", d.quantization, QUANTIZATIONS, _QUANTIZATION_WHY[d.stage_id]),
        enforce_eager=m.bool("enforce_eager", d.enforce_eager),
        async_scheduling=m.bool("async_scheduling", False, _SYNC_WHY[d.stage_id]),
        enable_prefix_caching=m.bool("enable_prefix_caching", False, _PREFIX_WHY[d.stage_id]),
        devices=_devices(m, d),
    )


def _edge(m: Section, key: str, edge: str, connectors: dict[str, ConnectorConfig]) -> dict[str, str]:
    e = m.sub(key, (edge,))
    name = e.data.get(edge, CONNECTOR)
    if not (isinstance(name, str) and name in connectors):
        raise e.bad(edge, name, f"a connector defined under connectors: {', '.join(connectors)}")
    return {edge: name}


def parse_stage0(m: Section, connectors: dict[str, ConnectorConfig]) -> Stage0Config:
    """Stage 0's block (the talker)."""
    d = Stage0Config()
    seqs = m.int("max_num_seqs", d.max_num_seqs, 2, MAX_NUM_SEQS, even=True,
                 allowed=f"an even integer in [2, {MAX_NUM_SEQS}] (rows: every song is a cond/uncond pair)")
    kw = _common(m, d, STAGE0_DTYPES, "the talker's weights and KV")
    if kw["quantization"] == "fp8" and kw["dtype"] != "bfloat16":
        raise m.bad("dtype", kw["dtype"], "bfloat16 with quantization: fp8 (the FP8 decode kernel takes bf16 "
                    "activations); or quantization: none")
    kw.update(
        max_model_len=m.int("max_model_len", d.max_model_len, MIN_CONTEXT, contract.MAX_CONTEXT,
                            f"an integer in [{MIN_CONTEXT}, {contract.MAX_CONTEXT}] (the shortest prompt, "
                            f"{contract.MIN_PROMPT_TOKENS} tokens, and a frame; at most the checkpoint's "
                            "max_position_embeddings)"),
        max_num_batched_tokens=m.int("max_num_batched_tokens", d.max_num_batched_tokens, 2, MAX_NUM_BATCHED_TOKENS,
                                     f"an integer in [2, {MAX_NUM_BATCHED_TOKENS}] (a prefill chunk gives both rows "
                                     "of a pair a token; at most every row prefilling a whole context)"),
    )
    s = m.sub("default_sampling_params", ("temperature", "max_tokens", "seed", "extra_args"))
    e = s.sub("extra_args", ("cfg_role", "cfg_scale"))
    sampling = Stage0Sampling(
        temperature=s.number("temperature", 1.0, lambda v: v == 1.0, "1.0 (the checkpoint's recipe: top-k 50 "
                             "sampling at temperature 1; the sampler has no temperature)"),
        max_tokens=s.int("max_tokens", d.default_sampling_params.max_tokens, MIN_STAGE0_MAX_TOKENS, allowed=(
            f"an integer >= {MIN_STAGE0_MAX_TOKENS}: a song of {contract.MAX_FRAMES} frames takes one step more, "
            "since the first sampled frame is fed back but not emitted; the final window leaves with the last frame")),
        seed=s.seed("seed", None),
        extra_args=CfgArgs(
            cfg_role=e.choice("cfg_role", "cond", ("cond",), "the request is the conditional row; the engine adds "
                              "the unconditional one"),
            cfg_scale=e.number("cfg_scale", contract.AR_CFG_SCALE, lambda v: v == contract.AR_CFG_SCALE,
                               f"{contract.AR_CFG_SCALE} (the checkpoint's guidance scale)"),
        ),
    )
    return Stage0Config(
        max_num_seqs=seqs,
        compilation_config=parse_compilation(m, seqs, "max_num_seqs", True, kw["enforce_eager"]),
        output_connectors=_edge(m, "output_connectors", "to_stage_1", connectors),
        default_sampling_params=sampling,
        **kw,
    )


def parse_stage1(m: Section, connectors: dict[str, ConnectorConfig], s0: Stage0Config, s0_output: str
                 ) -> Stage1Config:
    """Stage 1's block (the acoustic decoder), checked against stage 0 (`s0_output` names its output connector key)."""
    d = Stage1Config()
    longest = contract.frame_budget(contract.MAX_FRAMES, contract.MIN_PROMPT_TOKENS, s0.max_model_len)  # its longest song
    windows = len(contract.window_starts(longest))
    need = f"an integer >= {windows} (windows of the longest song stage 0 can write: {longest} frames)"
    seqs = m.int("max_num_seqs", d.max_num_seqs, 1, MAX_NUM_SEQS,
                 f"an integer in [1, {MAX_NUM_SEQS}] (songs per render call)")
    batched = m.int("max_num_batched_tokens", seqs, 1, MAX_NUM_BATCHED_TOKENS,
                    f"an integer in [1, {MAX_NUM_BATCHED_TOKENS}] (windows per render call)")
    kw = _common(m, d, STAGE1_DTYPES, "the DiT and vocoder precision policy")
    inputs = _edge(m, "input_connectors", "from_stage_0", connectors)
    if inputs["from_stage_0"] != s0.output_connectors["to_stage_1"]:
        raise m.sub("input_connectors", ("from_stage_0",)).bad(
            "from_stage_0", inputs["from_stage_0"],
            f"{quote(s0.output_connectors['to_stage_1'])}, the connector stage 0 writes to ({s0_output})")
    s = m.sub("default_sampling_params", ("temperature", "max_tokens", "seed"))
    sampling = Stage1Sampling(
        temperature=s.number("temperature", 0.0, lambda v: v == 0.0, "0.0 (stage 1 samples nothing: its output is "
                             "a deterministic function of the song's seed)"),
        max_tokens=s.int("max_tokens", d.default_sampling_params.max_tokens, windows, allowed=need),
        seed=s.int("seed", 0, 0, 0, "0 (stage 1 draws nothing: its DiT noise is keyed by the song's seed, which "
                   "the request or stage 0's seed sets, so another value here would change nothing)"),
    )
    return Stage1Config(
        max_num_seqs=seqs,
        max_model_len=m.int("max_model_len", d.max_model_len, windows, allowed=need),
        max_num_batched_tokens=batched,
        compilation_config=parse_compilation(m, min(seqs, batched), "min(max_num_seqs, max_num_batched_tokens)", False,
                                        kw["enforce_eager"]),
        input_connectors=inputs,
        default_sampling_params=sampling,
        **kw,
    )
