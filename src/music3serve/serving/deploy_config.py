"""The deploy YAML: pipeline, connectors and both stages, read into typed frozen dataclasses.

Every key of the seed deploy file drives this engine. Keys written for another engine's internals are
accepted where their value can be honored here and refused, with the reason, where it cannot. Unknown keys,
wrong types (a bool is not an int), out-of-range values and inconsistent combinations raise ConfigError naming
the file, the key path, the value and what is allowed. Missing keys take the defaults below, which
`default_deploy.yaml` spells out in full. Every key is described in docs/configuration.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .. import contract
from ..errors import Music3Error

if TYPE_CHECKING:
    from ..talker.engine import TalkerConfig

PIPELINE = "minimax_music3"
CONNECTOR = "connector_of_shared_memory"  # the default connector's name
CONNECTOR_CLASSES = ("SharedMemoryConnector",)
STAGE0_DTYPES = ("bfloat16", "float32")
STAGE1_DTYPES = ("float32", "bfloat16")
CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "NONE")
MIN_STAGE0_MAX_TOKENS = contract.MAX_FRAMES + 1  # steps of the longest song: the first sampled frame is not emitted
SEED_LIMIT = 2**63

_REFUSED_GRAPH_MODES = {
    "FULL": "prefill steps always run eager here; only the uniform frame step of decoding songs is captured",
    "PIECEWISE": "this engine captures the whole step as one graph and never splits it around attention",
    "FULL_AND_PIECEWISE": "this engine captures the whole step as one graph and never splits it around attention",
}
_NOT_COMPILED = "nothing is compiled here: the steps are our own eager modules, captured as CUDA graphs"
_REFUSED_COMPILATION_MODES = {1: _NOT_COMPILED, 2: _NOT_COMPILED, 3: _NOT_COMPILED}
_UNKNOWN_KEY_HINTS = {
    "input_connectors": " (stage 0 takes its requests from the API server; only stage 1 has input_connectors)",
    "output_connectors": " (stage 1 is the last stage: its PCM goes to the API server; only stage 0 has them)",
    "extra_args": " (only stage 0 has extra_args; stage 1's guidance is fixed by the checkpoint)",
}


class ConfigError(Music3Error, ValueError):
    """A deploy configuration that cannot be served as written."""


@dataclass(frozen=True)
class SharedMemoryExtra:
    codec_streaming: bool = True  # PCM goes to the client window by window, else as one piece at the end
    shm_threshold_bytes: int = 65536  # payloads of this size or more travel in shared memory, smaller ones inline
    connector_get_sleep_s: float = 0.01  # poll interval of a reader waiting for its next payload
    connector_get_max_wait_first_chunk_ms: int = 30000  # wait for a song's first window/chunk, then fail the song
    connector_get_max_wait_ms: int = 10000  # wait for each later one

    def as_extra(self) -> dict[str, Any]:
        """The `extra` block under its YAML key names (waits in milliseconds), as connectors read it."""
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
    max_tokens: int = len(contract.window_starts(contract.MAX_FRAMES))  # 89 windows
    seed: int | None = 0  # draws nothing at temperature 0; DiT noise is keyed by the song's seed


@dataclass(frozen=True)
class Stage0Config:
    """The talker. Rows, not songs: every song is a cond/uncond pair of rows."""

    stage_id: int = 0
    max_num_seqs: int = 16
    gpu_memory_utilization: float = 0.6
    dtype: str = "bfloat16"
    max_model_len: int = contract.MAX_CONTEXT
    max_num_batched_tokens: int = contract.MAX_CONTEXT
    enforce_eager: bool = False
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    async_scheduling: bool = False
    enable_prefix_caching: bool = False
    devices: tuple[int, ...] = (0,)
    output_connectors: dict[str, str] = field(default_factory=lambda: {"to_stage_1": CONNECTOR})
    default_sampling_params: Stage0Sampling = field(default_factory=Stage0Sampling)

    @property
    def graphs(self) -> bool:
        return not self.enforce_eager and self.compilation_config.cudagraph_mode != "NONE"


@dataclass(frozen=True)
class Stage1Config:
    """The acoustic decoder. One row per song; its "tokens" are windows (one per 100-frame hop)."""

    stage_id: int = 1
    max_num_seqs: int = 8
    gpu_memory_utilization: float = 0.2
    dtype: str = "float32"
    max_model_len: int = len(contract.window_starts(contract.MAX_FRAMES))  # 89 windows
    max_num_batched_tokens: int = 8
    enforce_eager: bool = False
    compilation_config: CompilationConfig = field(
        default_factory=lambda: CompilationConfig(cudagraph_capture_sizes=(1, 2, 4, 8))  # window batches, not rows
    )
    async_scheduling: bool = False
    enable_prefix_caching: bool = False
    devices: tuple[int, ...] = (0,)
    input_connectors: dict[str, str] = field(default_factory=lambda: {"from_stage_0": CONNECTOR})
    default_sampling_params: Stage1Sampling = field(default_factory=Stage1Sampling)

    @property
    def graphs(self) -> bool:
        return not self.enforce_eager and self.compilation_config.cudagraph_mode != "NONE"

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
        """The connector between the stages (also worker -> API server traffic)."""
        return self.connectors[self.stages[0].output_connectors["to_stage_1"]]

    def talker_config(self) -> "TalkerConfig":
        """Stage 0 as the talker engine's settings. Capture sizes count rows, so only even ones are kept."""
        from ..talker.engine import TalkerConfig

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


# Reading.
def load_deploy_config(path: Path | str | None = None) -> DeployConfig:
    """Read a deploy YAML; None reads the package's default_deploy.yaml."""
    try:
        if path is None:
            resource = resources.files(__package__).joinpath("default_deploy.yaml")
            source, text = f"{resource} (built-in default)", resource.read_text(encoding="utf-8")
        else:
            source, text = str(path), Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path or __package__}: cannot read the deploy config: {exc}") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    return parse_deploy_config(data, source)


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML would keep the last silently)."""


def _mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # unhashable: construct_mapping reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _bad(source: str, path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{source}: {path}: got {value!r}; allowed: {allowed}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


class _Map:
    """One mapping of the file: typed reads with defaults, after refusing keys not in `keys`."""

    def __init__(self, data: Any, path: str, source: str, keys: tuple[str, ...]):
        self.path, self.source = path, source
        if not isinstance(data, dict):
            raise _bad(source, path or "<top level>", data, f"a mapping with the keys {', '.join(keys)}")
        for key in data:
            if key not in keys:
                hint = _UNKNOWN_KEY_HINTS.get(key, "") if isinstance(key, str) else ""
                raise ConfigError(f"{source}: {self.key(key)}: unknown key{hint}; allowed here: {', '.join(keys)}")
        self.data = data

    def key(self, key: Any) -> str:
        return f"{self.path}.{key}" if self.path else str(key)

    def bad(self, key: str, value: Any, allowed: str) -> ConfigError:
        return _bad(self.source, self.key(key), value, allowed)

    def sub(self, key: str, keys: tuple[str, ...]) -> "_Map":
        return _Map(self.data.get(key, {}), self.key(key), self.source, keys)

    def bool(self, key: str, default: bool, refuse_true: str = "") -> bool:
        v = self.data.get(key, default)
        if not isinstance(v, bool) or (v and refuse_true):
            raise self.bad(key, v, f"false ({refuse_true})" if refuse_true else "true or false")
        return v

    def int(self, key: str, default: int, lo: int, hi: float = math.inf, allowed: str = "", even: bool = False) -> int:
        v = self.data.get(key, default)
        if not (_is_int(v) and lo <= v <= hi and not (even and v % 2)):
            span = f"an integer >= {lo}" if hi == math.inf else f"an integer in [{lo}, {hi}]"
            raise self.bad(key, v, allowed or span)
        return v

    def number(self, key: str, default: float, ok: Any, allowed: str) -> float:
        v = self.data.get(key, default)
        if not (_is_number(v) and ok(v)):
            raise self.bad(key, v, allowed)
        return float(v)

    def choice(self, key: str, default: str, choices: tuple[str, ...], why: str = "", refused: dict | None = None
               ) -> str:
        v = self.data.get(key, default)
        if not (isinstance(v, str) and v in choices):
            reason = (refused or {}).get(v) if isinstance(v, str) else None
            why = f" ({why})" if why else ""
            raise self.bad(key, v, " or ".join(choices) + why + (f"; refused: {reason}" if reason else ""))
        return v

    def seed(self, key: str, default: int | None) -> int | None:
        v = self.data.get(key, default)
        if v is not None and not (_is_int(v) and 0 <= v < SEED_LIMIT):
            raise self.bad(key, v, "null or an integer in [0, 2**63)")
        return v


def parse_deploy_config(data: Any, source: str) -> DeployConfig:
    """Validate a loaded YAML document (`source` names it in errors) into a DeployConfig."""
    top = _Map(data, "", source, ("pipeline", "async_chunk", "trust_remote_code", "connectors", "stages"))
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
            raise _bad(source, f"stages[{i}]", stage, "a mapping of stage keys, with stage_id 0 or 1")
        if "stage_id" not in stage:
            raise ConfigError(f"{source}: {path}: missing; every stage needs stage_id 0 (talker) or 1 (acoustic)")
        sid = stage["stage_id"]
        if not (_is_int(sid) and sid in (0, 1)):
            raise _bad(source, path, sid, "0 (the talker) or 1 (the acoustic decoder)")
        if sid in where:
            raise _bad(source, path, sid, f"each of 0 and 1 exactly once (stages[{where[sid]}] is already stage {sid})")
        where[sid] = i
    for sid in (0, 1):
        if sid not in where:
            raise ConfigError(f"{source}: stages: stage_id {sid} is missing; allowed: exactly two stages, 0 and 1")
    maps = [_Map(stages[where[s]], f"stages[{where[s]}]", source, _STAGE_KEYS + extra) for s, extra in _STAGE_EXTRA]
    s0 = _stage0(maps[0], connectors)
    s1 = _stage1(maps[1], connectors, s0, maps[0].key("output_connectors.to_stage_1"))
    for device in set(s0.devices) | set(s1.devices):
        users = [(m, s) for m, s in zip(maps, (s0, s1)) if device in s.devices]
        total = sum(s.gpu_memory_utilization for _, s in users)
        if len(users) > 1 and total > 1 + 1e-9:
            m, s = users[-1]
            raise m.bad("gpu_memory_utilization", s.gpu_memory_utilization,
                        f"a fraction that keeps the sum over the stages on GPU {device} <= 1 (it is {total:g})")
    return DeployConfig(pipeline, async_chunk, trust_remote_code, connectors, (s0, s1), source)


_STAGE_KEYS = ("stage_id", "max_num_seqs", "gpu_memory_utilization", "dtype", "max_model_len", "max_num_batched_tokens",
               "enforce_eager", "compilation_config", "async_scheduling", "enable_prefix_caching", "devices")
_STAGE_EXTRA = ((0, ("output_connectors", "default_sampling_params")),
                (1, ("input_connectors", "default_sampling_params")))
_EXTRA_KEYS = ("codec_streaming", "shm_threshold_bytes", "connector_get_sleep_s", "connector_get_max_wait_first_chunk",
               "connector_get_max_wait")
_COMPILATION_KEYS = ("mode", "cudagraph_capture_sizes", "cudagraph_mode", "cudagraph_num_of_warmups", "custom_ops")


def _connectors(top: _Map) -> dict[str, ConnectorConfig]:
    raw = top.data.get("connectors", {CONNECTOR: {}})
    if not isinstance(raw, dict) or not raw:
        raise top.bad("connectors", raw, "a non-empty mapping of connector names to {name, extra}")
    out, d = {}, SharedMemoryExtra()
    for cname in raw:
        if not (isinstance(cname, str) and cname.strip()):
            raise top.bad("connectors", cname, "connector names that are non-empty strings")
        m = _Map(raw[cname], f"connectors.{cname}", top.source, ("name", "extra"))
        name = m.choice("name", "SharedMemoryConnector", CONNECTOR_CLASSES, "the only connector this engine has")
        e = m.sub("extra", _EXTRA_KEYS)
        first = e.int("connector_get_max_wait_first_chunk", d.connector_get_max_wait_first_chunk_ms, 1,
                      allowed="an integer >= 1 (milliseconds)")
        later = e.int("connector_get_max_wait", d.connector_get_max_wait_ms, 1,
                      allowed="an integer >= 1 (milliseconds)")
        limit = min(first, later) / 1000
        extra = SharedMemoryExtra(
            codec_streaming=e.bool("codec_streaming", d.codec_streaming),
            shm_threshold_bytes=e.int("shm_threshold_bytes", d.shm_threshold_bytes, 0),
            connector_get_sleep_s=e.number("connector_get_sleep_s", d.connector_get_sleep_s, lambda v: 0 < v <= limit,
                                           f"seconds in (0, {limit:g}]: a poll must fit in the shorter max wait"),
            connector_get_max_wait_first_chunk_ms=first,
            connector_get_max_wait_ms=later,
        )
        out[cname] = ConnectorConfig(name, extra)
    return out


def _common(m: _Map, d: Stage0Config | Stage1Config, dtypes: tuple[str, ...], dtype_why: str) -> dict[str, Any]:
    devices = m.data.get("devices", ",".join(map(str, d.devices)))
    text = str(devices) if _is_int(devices) and devices >= 0 else devices
    if not (isinstance(text, str) and re.fullmatch(r"\s*[0-9]+\s*(,\s*[0-9]+\s*)*", text)):
        raise m.bad("devices", devices, 'a string of comma-separated GPU indices, e.g. "0"')
    ids = tuple(int(x) for x in text.split(","))
    if len(ids) != 1:
        raise m.bad("devices", devices, "one GPU index (each stage runs on one GPU: no tensor or data parallelism)")
    return dict(
        gpu_memory_utilization=m.number("gpu_memory_utilization", d.gpu_memory_utilization, lambda v: 0 < v <= 1,
                                        "a number in (0, 1]"),
        dtype=m.choice("dtype", d.dtype, dtypes, dtype_why),
        enforce_eager=m.bool("enforce_eager", d.enforce_eager),
        async_scheduling=m.bool("async_scheduling", False, "steps here are synchronous: a song's pair is sampled, and "
                                "its window carry handed on, inside one step before the next is planned"),
        enable_prefix_caching=m.bool("enable_prefix_caching", False, "KV lives in one static slot per song pair and "
                                     "is never shared; a cached uncond prefix would skew a pair's positions"),
        devices=ids,
    )


def _compilation(m: _Map, limit: int, limit_name: str, pairs: bool, enforce_eager: bool) -> CompilationConfig:
    c = m.sub("compilation_config", _COMPILATION_KEYS)
    mode = c.data.get("mode", 0)
    if not (_is_int(mode) and mode == 0):
        reason = _REFUSED_COMPILATION_MODES.get(mode) if _is_int(mode) else None
        raise c.bad("mode", mode, "0 (no compilation)" + (f"; refused: {reason}" if reason else ""))
    sizes = c.data.get("cudagraph_capture_sizes")
    if "cudagraph_capture_sizes" not in c.data:  # default: powers of two up to the limit, and the limit
        sizes = [s for s in (2 ** k for k in range(limit.bit_length())) if s <= limit and (s > 1 or not pairs)]
        sizes = sizes + [limit] * (limit not in sizes)
    allowed = f"a list of distinct integers in [1, {limit_name} = {limit}]"
    if not (isinstance(sizes, list) and all(_is_int(s) and 1 <= s <= limit for s in sizes)
            and len(set(sizes)) == len(sizes)):
        raise c.bad("cudagraph_capture_sizes", sizes, allowed)
    graph_mode = c.choice("cudagraph_mode", "FULL_DECODE_ONLY", CUDAGRAPH_MODES, refused=_REFUSED_GRAPH_MODES)
    if pairs and not enforce_eager and graph_mode != "NONE" and not any(s % 2 == 0 for s in sizes):
        raise c.bad("cudagraph_capture_sizes", sizes, f"{allowed} with at least one even size (sizes count rows, "
                    "which come in cond/uncond pairs), or enforce_eager: true")
    warmups = c.int("cudagraph_num_of_warmups", 1, 1, 1, "1 (each capture size runs eagerly once before capture: "
                    "kernel choice and Triton builds must not land inside a graph; the graph builders run exactly one)")
    ops = c.data.get("custom_ops", ["all"])
    if not (isinstance(ops, list) and all(op == "all" for op in ops)):
        raise c.bad("custom_ops", ops, '["all"] or [] (this engine\'s own kernels are always used where they exist; '
                    '"none" and per-op "+name"/"-name" switches cannot be honored)')
    return CompilationConfig(mode, tuple(sizes), graph_mode, warmups, tuple(ops))


def _edge(m: _Map, key: str, edge: str, connectors: dict[str, ConnectorConfig]) -> dict[str, str]:
    e = m.sub(key, (edge,))
    name = e.data.get(edge, CONNECTOR)
    if not (isinstance(name, str) and name in connectors):
        raise e.bad(edge, name, f"a connector defined under connectors: {', '.join(connectors)}")
    return {edge: name}


def _stage0(m: _Map, connectors: dict[str, ConnectorConfig]) -> Stage0Config:
    d = Stage0Config()
    seqs = m.int("max_num_seqs", d.max_num_seqs, 2, even=True,
                 allowed="an even integer >= 2 (rows: every song is a cond/uncond pair)")
    kw = _common(m, d, STAGE0_DTYPES, "the talker's weights and KV")
    kw.update(
        max_model_len=m.int("max_model_len", d.max_model_len, 1, contract.MAX_CONTEXT,
                            f"an integer in [1, {contract.MAX_CONTEXT}] (the checkpoint's max_position_embeddings)"),
        max_num_batched_tokens=m.int("max_num_batched_tokens", d.max_num_batched_tokens, 2,
                                     allowed="an integer >= 2 (a prefill chunk gives both rows of a pair a token)"),
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


def _stage1(m: _Map, connectors: dict[str, ConnectorConfig], s0: Stage0Config, s0_output: str) -> Stage1Config:
    d = Stage1Config()
    longest = max(1, min(contract.MAX_FRAMES, s0.max_model_len - 1))  # frames of the longest song stage 0 can write
    windows = len(contract.window_starts(longest))
    need = f"an integer >= {windows} (windows of the longest song stage 0 can write: {longest} frames)"
    seqs = m.int("max_num_seqs", d.max_num_seqs, 1, allowed="an integer >= 1 (songs stage 1 holds and batches)")
    batched = m.int("max_num_batched_tokens", seqs, 1, allowed="an integer >= 1 (windows per render call)")
    kw = _common(m, d, STAGE1_DTYPES, "the DiT and vocoder precision policy")
    inputs = _edge(m, "input_connectors", "from_stage_0", connectors)
    if inputs["from_stage_0"] != s0.output_connectors["to_stage_1"]:
        raise m.sub("input_connectors", ("from_stage_0",)).bad(
            "from_stage_0", inputs["from_stage_0"], f"{s0.output_connectors['to_stage_1']!r}, the connector stage 0 "
            f"writes to ({s0_output})")
    s = m.sub("default_sampling_params", ("temperature", "max_tokens", "seed"))
    sampling = Stage1Sampling(
        temperature=s.number("temperature", 0.0, lambda v: v == 0.0, "0.0 (stage 1 samples nothing: its output is "
                             "a deterministic function of the song's seed)"),
        max_tokens=s.int("max_tokens", d.default_sampling_params.max_tokens, windows, allowed=need),
        seed=s.seed("seed", 0),
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
