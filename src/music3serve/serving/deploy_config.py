"""The deploy YAML: pipeline, connectors and both stages, read into typed frozen dataclasses.

Every key of the staged-engine deploy format (examples/deploy/minimax_music3.yaml) drives this engine. Keys written
for another engine's internals are accepted where their value can be honored here and refused, with the reason,
where it cannot. Unknown keys, wrong types (a bool is not an int), out-of-range values and inconsistent combinations
raise ConfigError naming the file, the key path, the value and what is allowed. Missing keys take the defaults of
:mod:`.deploy_schema`, which `default_deploy.yaml` spells out in full. Every key is described in
docs/configuration.md.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import contract
from .deploy_schema import (
    CONNECTOR,
    MAX_GPU_INDEX,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    MAX_WAIT_MS,
    MAX_WINDOWS,
    MIN_SLEEP_S,
    MIN_STAGE0_MAX_TOKENS,
    QUANTIZATIONS,
    PIPELINE,
    SEED_LIMIT,
    CfgArgs,
    CompilationConfig,
    ConnectorConfig,
    DeployConfig,
    SharedMemoryExtra,
    Stage0Config,
    Stage0Sampling,
    Stage1Config,
    Stage1Sampling,
)
from .deploy_yaml import ConfigError, Section, bad, is_int, quote, read_deploy_yaml

__all__ = [
    "CONNECTOR",
    "CONNECTOR_CLASSES",
    "CUDAGRAPH_MODES",
    "MAX_GPU_INDEX",
    "MAX_NUM_BATCHED_TOKENS",
    "MAX_NUM_SEQS",
    "MAX_WAIT_MS",
    "MAX_WINDOWS",
    "MIN_SLEEP_S",
    "MIN_STAGE0_MAX_TOKENS",
    "PIPELINE",
    "SEED_LIMIT",
    "STAGE0_DTYPES",
    "STAGE1_DTYPES",
    "CfgArgs",
    "CompilationConfig",
    "ConfigError",
    "ConnectorConfig",
    "DeployConfig",
    "SharedMemoryExtra",
    "Stage0Config",
    "Stage0Sampling",
    "Stage1Config",
    "Stage1Sampling",
    "load_deploy_config",
    "parse_deploy_config",
    "with_quantization",
]

CONNECTOR_CLASSES = ("SharedMemoryConnector",)
STAGE0_DTYPES = ("bfloat16", "float32")
STAGE1_DTYPES = ("float32", "bfloat16")
CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "NONE")
MIN_CONTEXT = contract.MIN_PROMPT_TOKENS + 1  # stage 0's max_model_len: a shorter one could serve no song

_REFUSED_GRAPH_MODES = {
    "FULL": "prefill steps always run eager here; only the uniform frame step of decoding songs is captured",
    "PIECEWISE": "this engine captures the whole step as one graph and never splits it around attention",
    "FULL_AND_PIECEWISE": "this engine captures the whole step as one graph and never splits it around attention",
}
_REFUSED_COMPILATION_MODES = dict.fromkeys(
    (1, 2, 3), "nothing is compiled here: the steps are our own eager modules, captured as CUDA graphs"
)


def load_deploy_config(path: Path | str | None = None) -> DeployConfig:
    """Read a deploy YAML; None reads the package's default_deploy.yaml."""
    return parse_deploy_config(*read_deploy_yaml(path))


def parse_deploy_config(data: Any, source: str) -> DeployConfig:
    """Validate a loaded YAML document (`source` names it in errors) into a DeployConfig."""
    top = Section(data, "", source, ("pipeline", "async_chunk", "trust_remote_code", "connectors", "stages"))
    pipeline = top.choice("pipeline", PIPELINE, (PIPELINE,), "this engine serves MiniMax-Music3 only")
    async_chunk = top.bool("async_chunk", True)
    trust_remote_code = top.bool("trust_remote_code", False)  # either way: no remote code is ever run here
    connectors = _connectors(top)
    stages = top.data.get("stages", [{"stage_id": 0}, {"stage_id": 1}])
    if not isinstance(stages, list):
        raise top.bad("stages", stages, "a list of two stages, stage_id 0 (talker) and 1 (acoustic decoder)")
    where: dict[int, int] = {}
    for i, stage in enumerate(stages):
        path = f"stages[{i}].stage_id"
        if not isinstance(stage, dict):
            raise bad(source, f"stages[{i}]", stage, "a mapping of stage keys, with stage_id 0 or 1")
        if "stage_id" not in stage:
            raise ConfigError(f"{source}: {path}: missing; every stage needs stage_id 0 (talker) or 1 (acoustic)")
        sid = stage["stage_id"]
        if not (is_int(sid) and sid in (0, 1)):
            raise bad(source, path, sid, "0 (the talker) or 1 (the acoustic decoder)")
        if sid in where:
            raise bad(source, path, sid, f"each of 0 and 1 exactly once (stages[{where[sid]}] is already stage {sid})")
        where[sid] = i
    for sid in (0, 1):
        if sid not in where:
            raise ConfigError(f"{source}: stages: stage_id {sid} is missing; allowed: exactly two stages, 0 and 1")
    maps = [Section(stages[where[s]], f"stages[{where[s]}]", source, _STAGE_KEYS + extra) for s, extra in _STAGE_EXTRA]
    s0 = _stage0(maps[0], connectors)
    s1 = _stage1(maps[1], connectors, s0, maps[0].key("output_connectors.to_stage_1"))
    for device in set(s0.devices) | set(s1.devices):
        users = [(m, s) for m, s in zip(maps, (s0, s1)) if device in s.devices]
        total = sum(s.gpu_memory_utilization for _, s in users)
        if len(users) > 1 and total > 1 + 1e-9:
            m, s = users[-1]
            raise m.bad("gpu_memory_utilization", s.gpu_memory_utilization,
                        f"a fraction that keeps the sum over the stages on GPU {device} <= 1 (it is {total:g})")
    used = s0.output_connectors["to_stage_1"]  # stage 1 reads from the same one
    for name in connectors:
        if name != used:  # its settings would be validated, then never applied
            raise ConfigError(f"{source}: connectors.{name}: unused: no stage writes to or reads from it; allowed: "
                              f"only the connector the stages use, {quote(used)} "
                              f"({maps[0].key('output_connectors.to_stage_1')})")
    return DeployConfig(pipeline, async_chunk, trust_remote_code, connectors, (s0, s1), source)


def with_quantization(deploy: DeployConfig, quantization: str) -> DeployConfig:
    """`deploy` with both stages' `quantization` set (serve's --quantization); fp8 needs stage 0 in bfloat16."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization: {quantization!r}; allowed: {' or '.join(QUANTIZATIONS)}")
    s0, s1 = deploy.stages
    if quantization == "fp8" and s0.dtype != "bfloat16":
        raise ConfigError(f"--quantization fp8: stage 0 has dtype {s0.dtype} in {deploy.source}; allowed: dtype "
                          "bfloat16 (the FP8 decode kernel takes bf16 activations)")
    stages = (replace(s0, quantization=quantization), replace(s1, quantization=quantization))
    return replace(deploy, stages=stages)


def with_stage1_dtype(deploy: DeployConfig, dtype: str) -> DeployConfig:
    """`deploy` with stage 1's `dtype` (the benchmarks' bf16 acoustic decoder)."""
    return replace(deploy, stages=(deploy.stages[0], replace(deploy.stages[1], dtype=dtype)))


_STAGE_KEYS = ("stage_id", "max_num_seqs", "gpu_memory_utilization", "dtype", "quantization", "max_model_len",
               "max_num_batched_tokens", "enforce_eager", "compilation_config", "async_scheduling", "enable_prefix_caching", "devices")
_STAGE_EXTRA = ((0, ("output_connectors", "default_sampling_params")),
                (1, ("input_connectors", "default_sampling_params")))
_EXTRA_KEYS = tuple(SharedMemoryExtra().as_extra())
_COMPILATION_KEYS = ("mode", "cudagraph_capture_sizes", "cudagraph_mode", "cudagraph_num_of_warmups", "custom_ops")


def _connectors(top: Section) -> dict[str, ConnectorConfig]:
    raw = top.data.get("connectors", {CONNECTOR: {}})
    if not isinstance(raw, dict) or not raw:
        raise top.bad("connectors", raw, "a non-empty mapping of connector names to {name, extra}")
    out = {}
    for cname in raw:
        if not (isinstance(cname, str) and cname.strip()):
            raise top.bad("connectors", cname, "connector names that are non-empty strings")
        m = Section(raw[cname], f"connectors.{cname}", top.source, ("name", "extra"))
        name = m.choice("name", "SharedMemoryConnector", CONNECTOR_CLASSES, "the only connector this engine has")
        out[cname] = ConnectorConfig(name, _extra(m.sub("extra", _EXTRA_KEYS)))
    return out


def connector_extra(data: Any) -> SharedMemoryExtra:
    """A connector's `extra` block given on its own (a mapping under the YAML's key names; None: the defaults),
    checked as in a deploy file."""
    return _extra(Section({} if data is None else data, "extra", "connector settings", _EXTRA_KEYS))


def _extra(e: Section) -> SharedMemoryExtra:
    d = SharedMemoryExtra()
    waits = f"an integer in [1, {MAX_WAIT_MS}] (milliseconds: up to a day)"
    first = e.int("connector_get_max_wait_first_chunk", d.connector_get_max_wait_first_chunk_ms, 1, MAX_WAIT_MS, waits)
    later = e.int("connector_get_max_wait", d.connector_get_max_wait_ms, 1, MAX_WAIT_MS, waits)
    limit = min(first, later) / 1000
    return SharedMemoryExtra(
        codec_streaming=e.bool("codec_streaming", d.codec_streaming),
        shm_threshold_bytes=e.int("shm_threshold_bytes", d.shm_threshold_bytes, 0),
        connector_get_sleep_s=e.number(
            "connector_get_sleep_s", d.connector_get_sleep_s, lambda v: MIN_SLEEP_S <= v <= limit,
            f"seconds in [{MIN_SLEEP_S:g}, {limit:g}]: a poll must fit in the shorter max wait, and a shorter one "
            "only spins a CPU core (a payload wakes the reader at once)"),
        connector_get_max_wait_first_chunk_ms=first,
        connector_get_max_wait_ms=later,
    )


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


def _compilation(m: Section, limit: int, limit_name: str, pairs: bool, enforce_eager: bool) -> CompilationConfig:
    c = m.sub("compilation_config", _COMPILATION_KEYS)
    mode = c.data.get("mode", 0)
    if not (is_int(mode) and mode == 0):
        reason = _REFUSED_COMPILATION_MODES.get(mode) if is_int(mode) else None
        raise c.bad("mode", mode, "0 (no compilation)" + (f"; refused: {reason}" if reason else ""))
    if "cudagraph_capture_sizes" in c.data:
        sizes = c.data["cudagraph_capture_sizes"]
    elif pairs:  # row counts: powers of two from 2 up to the limit, and the limit (fewer rows replay the next size up)
        sizes = [2**k for k in range(1, limit.bit_length())]
        if limit not in sizes:
            sizes.append(limit)
    else:  # window batches: every size (a batch of a size without a graph runs eagerly)
        sizes = list(range(1, limit + 1))
    allowed = f"a list of distinct integers in [1, {limit_name} = {limit}]"
    if not (isinstance(sizes, list) and all(is_int(s) and 1 <= s <= limit for s in sizes)
            and len(set(sizes)) == len(sizes)):
        raise c.bad("cudagraph_capture_sizes", sizes, allowed)
    graph_mode = c.choice("cudagraph_mode", "FULL_DECODE_ONLY", CUDAGRAPH_MODES, refused=_REFUSED_GRAPH_MODES)
    if pairs and not enforce_eager and graph_mode != "NONE" and not any(s % 2 == 0 for s in sizes):
        raise c.bad("cudagraph_capture_sizes", sizes, f"{allowed} with at least one even size (sizes count rows, "
                    "which come in cond/uncond pairs), or enforce_eager: true")
    warmups = c.int("cudagraph_num_of_warmups", 1, 1, 1, "1 (each capture size runs eagerly once before capture: "
                    "kernel choice and Triton builds must not land inside a graph; the graph builders run exactly one)")
    ops = c.data.get("custom_ops", ["all"])
    if ops not in ([], ["all"]):
        raise c.bad("custom_ops", ops, '["all"] or [] (this engine\'s own kernels are always used where they exist; '
                    '"none" and per-op "+name"/"-name" switches cannot be honored)')
    return CompilationConfig(mode, tuple(sizes), graph_mode, warmups, tuple(ops))


def _edge(m: Section, key: str, edge: str, connectors: dict[str, ConnectorConfig]) -> dict[str, str]:
    e = m.sub(key, (edge,))
    name = e.data.get(edge, CONNECTOR)
    if not (isinstance(name, str) and name in connectors):
        raise e.bad(edge, name, f"a connector defined under connectors: {', '.join(connectors)}")
    return {edge: name}


def _stage0(m: Section, connectors: dict[str, ConnectorConfig]) -> Stage0Config:
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
        compilation_config=_compilation(m, seqs, "max_num_seqs", True, kw["enforce_eager"]),
        output_connectors=_edge(m, "output_connectors", "to_stage_1", connectors),
        default_sampling_params=sampling,
        **kw,
    )


def _stage1(m: Section, connectors: dict[str, ConnectorConfig], s0: Stage0Config, s0_output: str) -> Stage1Config:
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
        compilation_config=_compilation(m, min(seqs, batched), "min(max_num_seqs, max_num_batched_tokens)", False,
                                        kw["enforce_eager"]),
        input_connectors=inputs,
        default_sampling_params=sampling,
        **kw,
    )
