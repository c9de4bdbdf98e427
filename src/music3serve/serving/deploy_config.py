"""The deploy YAML: pipeline, connectors and both stages, read into typed frozen dataclasses.

Every key of the staged-engine deploy format (examples/deploy/minimax_music3.yaml) drives this engine. Keys written
for another engine's internals are accepted where their value can be honored here and refused, with the reason,
where it cannot. Unknown keys, wrong types (a bool is not an int), out-of-range values and inconsistent combinations
raise ConfigError naming the file, the key path, the value and what is allowed. Missing keys take the defaults of
:mod:`.deploy_schema`, which `default_deploy.yaml` spells out in full. Every key is described in
docs/configuration.md. This file reads the top level and the connectors; :mod:`.deploy_stages` reads the two stages.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from .deploy_compilation import CUDAGRAPH_MODES
from .deploy_errors import ConfigError, bad, quote
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
from .deploy_section import Section, is_int
from .deploy_stages import STAGE0_DTYPES, STAGE1_DTYPES, STAGE_EXTRA, STAGE_KEYS, parse_stage0, parse_stage1
from .deploy_yaml import read_deploy_yaml

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
    "connector_extra",
    "load_deploy_config",
    "parse_deploy_config",
    "with_quantization",
    "with_stage1_dtype",
]

CONNECTOR_CLASSES = ("SharedMemoryConnector",)


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
    stages = top.data.get("stages", [])  # a stage left out takes its defaults
    if not isinstance(stages, list):
        raise top.bad("stages", stages, "a list of the stages to change: stage_id 0 (talker), 1 (acoustic decoder) "
                                        "or both")
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
    extras = dict(STAGE_EXTRA)

    def block(sid: int, unlisted: dict[str, Any]) -> Section:
        """The stage's block in the file; one it leaves out takes its defaults (`unlisted`)."""
        if sid in where:
            return Section(stages[where[sid]], f"stages[{where[sid]}]", source, STAGE_KEYS + extras[sid])
        return Section(unlisted, f"stages[stage {sid}: defaults]", source, STAGE_KEYS + extras[sid])

    maps = [block(0, _unlisted_stage0(stages, where, connectors))]
    s0 = parse_stage0(maps[0], connectors)
    maps.append(block(1, {"stage_id": 1, "input_connectors": {"from_stage_0": s0.output_connectors["to_stage_1"]},
                          **_listed_devices(stages, where)}))
    s1 = parse_stage1(maps[1], connectors, s0, maps[0].key("output_connectors.to_stage_1"))
    for device in set(s0.devices) | set(s1.devices):
        users = [(m, s) for m, s in zip(maps, (s0, s1)) if device in s.devices]
        total = sum(s.gpu_memory_utilization for _, s in users)
        if len(users) > 1 and total > 1 + 1e-9:
            m, s = next(((m, s) for m, s in reversed(users) if s.stage_id in where), users[-1])  # blame a listed stage
            unlisted = "".join(f"; stage {u.stage_id}, not listed, takes its default {u.gpu_memory_utilization:g}"
                               for _, u in users if u.stage_id not in where)
            raise m.bad("gpu_memory_utilization", s.gpu_memory_utilization,
                        f"a fraction that keeps the sum over the stages on GPU {device} <= 1 (it is {total:g}"
                        f"{unlisted})")
    used = s0.output_connectors["to_stage_1"]  # stage 1 reads from the same one
    for name in connectors:
        if name != used:  # its settings would be validated, then never applied
            raise ConfigError(f"{source}: connectors.{name}: unused: no stage writes to or reads from it; allowed: "
                              f"only the connector the stages use, {quote(used)} "
                              f"({maps[0].key('output_connectors.to_stage_1')})")
    return DeployConfig(pipeline, async_chunk, trust_remote_code, connectors, (s0, s1), source)


def _listed_devices(stages: list, where: dict[int, int]) -> dict[str, Any]:
    """For the stage a file leaves out: the other stage's `devices` where the file sets them, so that the stages
    stay together (split placement only where a file lists both stages on different GPUs)."""
    listed = [stages[i] for i in where.values()]
    return {"devices": listed[0]["devices"]} if len(listed) == 1 and "devices" in listed[0] else {}


def _unlisted_stage0(stages: list, where: dict[int, int], connectors: dict[str, ConnectorConfig]) -> dict[str, Any]:
    """Stage 0's block where the file leaves it out: its defaults, writing to the connector stage 1 reads from where
    that is one of the file's (else stage 1's own check names it)."""
    block: dict[str, Any] = {"stage_id": 0, **_listed_devices(stages, where)}
    if 1 in where:
        edge = stages[where[1]].get("input_connectors")
        name = edge.get("from_stage_0") if isinstance(edge, dict) else None
        if isinstance(name, str) and name in connectors:
            block["output_connectors"] = {"to_stage_1": name}
    return block


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
    """`deploy` with stage 1's `dtype` (serve's --acoustic-dtype); float32 is refused where stage 1 runs FP8, whose
    activations are bf16 (the file's dtype is overridden there, an explicit flag is not)."""
    if dtype == "float32" and deploy.stages[1].quantization == "fp8":
        raise ConfigError(f"--acoustic-dtype float32: stage 1 has quantization fp8 in {deploy.source}, which runs "
                          "bf16 activations; drop --acoustic-dtype float32, or give --quantization none")
    return replace(deploy, stages=(deploy.stages[0], replace(deploy.stages[1], dtype=dtype)))


_EXTRA_KEYS = tuple(SharedMemoryExtra().as_extra())


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
