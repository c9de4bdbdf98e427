"""The deploy YAML: examples/deploy/minimax_music3.yaml as written, our default, defaults for missing keys, and one
refusal per rule."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import time
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from music3serve import contract
from music3serve.errors import Music3Error
from music3serve.serving.deploy_config import (
    MAX_GPU_INDEX,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    MAX_WAIT_MS,
    MIN_SLEEP_S,
    CompilationConfig,
    ConfigError,
    DeployConfig,
    SharedMemoryExtra,
    Stage0Config,
    Stage0Sampling,
    Stage1Config,
    Stage1Sampling,
    load_deploy_config,
    parse_deploy_config,
)
from music3serve.serving.deploy_yaml import MAX_DEPTH, read_deploy_yaml
from music3serve.talker.config import TalkerConfig

EXAMPLE = Path(__file__).parents[1] / "examples" / "deploy" / "minimax_music3.yaml"
SOURCE = "deploy.yaml"
DELETE = object()


def default_dict() -> dict:
    text = resources.files("music3serve.serving").joinpath("default_deploy.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


BASE = default_dict()


def mutated(*changes: tuple[tuple, Any]) -> dict:
    data = copy.deepcopy(BASE)
    for path, value in changes:
        node = data
        for key in path[:-1]:
            node = node[key]
        if value is DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return data


def path_text(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


# The example deploy file, as written.
def test_example_loads_as_written():
    cfg = load_deploy_config(EXAMPLE)
    s0, s1 = cfg.stages
    assert (cfg.pipeline, cfg.async_chunk, cfg.trust_remote_code) == ("minimax_music3", True, True)
    assert list(cfg.connectors) == ["connector_of_shared_memory"]
    extra = cfg.connector.extra
    assert cfg.connector.name == "SharedMemoryConnector"
    assert (extra.codec_streaming, extra.shm_threshold_bytes, extra.connector_get_sleep_s) == (True, 65536, 0.01)
    assert (extra.connector_get_max_wait_first_chunk_ms, extra.connector_get_max_wait_ms) == (30000, 10000)
    assert extra.as_extra() == yaml.safe_load(EXAMPLE.read_text())["connectors"]["connector_of_shared_memory"]["extra"]
    assert (s0.stage_id, s0.max_num_seqs, s0.gpu_memory_utilization, s0.dtype) == (0, 16, 0.6, "bfloat16")
    assert (s0.max_model_len, s0.max_num_batched_tokens, s0.enforce_eager) == (10240, 10240, False)
    c = s0.compilation_config
    assert (c.mode, c.cudagraph_capture_sizes, c.cudagraph_mode) == (0, (1, 2, 4, 8, 16), "FULL_DECODE_ONLY")
    assert (c.cudagraph_num_of_warmups, c.custom_ops) == (1, ("all",))
    assert (s0.async_scheduling, s0.enable_prefix_caching, s0.devices) == (False, False, (0,))
    assert s0.output_connectors == {"to_stage_1": "connector_of_shared_memory"}
    p = s0.default_sampling_params
    assert (p.temperature, p.max_tokens, p.seed) == (1.0, 9002, None)
    assert (p.extra_args.cfg_role, p.extra_args.cfg_scale) == ("cond", contract.AR_CFG_SCALE)
    assert (s1.stage_id, s1.max_num_seqs, s1.gpu_memory_utilization, s1.dtype, s1.enforce_eager) == (
        1, 8, 0.2, "float32", True)
    assert (s1.max_model_len, s1.max_num_batched_tokens, s1.render_batch, s1.graphs) == (4096, 4096, 8, False)
    assert (s1.async_scheduling, s1.enable_prefix_caching, s1.devices) == (False, False, (0,))
    assert s1.input_connectors == {"from_stage_0": "connector_of_shared_memory"}
    q = s1.default_sampling_params
    assert (q.temperature, q.max_tokens, q.seed) == (0.0, 4096, 0)
    assert s1.compilation_config.cudagraph_capture_sizes == (1, 2, 3, 4, 5, 6, 7, 8)  # not in the example: every size


def test_example_maps_to_the_talker_config():
    talker = load_deploy_config(EXAMPLE).talker_config()
    assert talker == TalkerConfig(
        max_num_seqs=16, max_model_len=10240, max_num_batched_tokens=10240, capture_sizes=(2, 4, 8, 16),
        enforce_eager=False, gpu_memory_utilization=0.6,
    )


# Our default and the defaults of missing keys.
def test_default_file_ships_with_the_package_and_loads():
    assert resources.files("music3serve.serving").joinpath("default_deploy.yaml").is_file()
    cfg = load_deploy_config(None)
    assert "default_deploy.yaml" in cfg.source
    assert cfg.stages[1].dtype == "float32" and cfg.stages[1].enforce_eager is False
    assert cfg.talker_config() == TalkerConfig()


def test_default_file_is_the_complete_set_of_defaults():
    assert load_deploy_config(None) == parse_deploy_config({}, SOURCE) == DeployConfig()
    names = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
    s0, s1 = BASE["stages"]
    assert BASE.keys() == names(DeployConfig) - {"source"}
    assert s0.keys() == names(Stage0Config) and s1.keys() == names(Stage1Config)
    assert s0["compilation_config"].keys() == s1["compilation_config"].keys() == names(CompilationConfig)
    assert s0["default_sampling_params"].keys() == names(Stage0Sampling)
    assert s1["default_sampling_params"].keys() == names(Stage1Sampling)
    extra = BASE["connectors"]["connector_of_shared_memory"]["extra"]
    assert {k + "_ms" if "max_wait" in k else k for k in extra} == names(SharedMemoryExtra)


def test_missing_keys_take_defaults_and_stage_order_is_free():
    stages = [{"stage_id": 1, "max_num_seqs": 3}, {"stage_id": 0, "max_num_seqs": 6}]
    cfg = parse_deploy_config({"stages": stages}, SOURCE)
    s0, s1 = cfg.stages
    assert (s0.stage_id, s0.max_num_seqs, s0.compilation_config.cudagraph_capture_sizes) == (0, 6, (2, 4, 6))
    assert (s1.stage_id, s1.max_num_seqs, s1.max_num_batched_tokens, s1.render_batch) == (1, 3, 3, 3)
    assert s1.compilation_config.cudagraph_capture_sizes == (1, 2, 3)
    assert s0.default_sampling_params.max_tokens == contract.MAX_FRAMES + 1


def test_a_file_lists_only_the_stages_it_changes():
    """A stage left out takes its defaults, on the listed stage's devices, reading from (or writing to) the connector
    the listed stage names."""
    assert parse_deploy_config({"stages": []}, SOURCE) == DeployConfig(source=SOURCE)
    s0, s1 = parse_deploy_config({"stages": [{"stage_id": 0, "max_num_seqs": 6, "devices": "1"}]}, SOURCE).stages
    assert (s0.max_num_seqs, s0.devices) == (6, (1,))
    assert s1 == dataclasses.replace(DeployConfig().stages[1], devices=(1,))
    s0, s1 = parse_deploy_config({"stages": [{"stage_id": 1, "max_num_seqs": 3}]}, SOURCE).stages
    assert s0 == DeployConfig().stages[0] and s1.max_num_seqs == 3
    connectors = {"mine": {"name": "SharedMemoryConnector"}}
    for listed in ({"stage_id": 0, "output_connectors": {"to_stage_1": "mine"}},
                   {"stage_id": 1, "input_connectors": {"from_stage_0": "mine"}}):
        s0, s1 = parse_deploy_config({"connectors": connectors, "stages": [listed]}, SOURCE).stages
        assert s0.output_connectors == {"to_stage_1": "mine"} and s1.input_connectors == {"from_stage_0": "mine"}


def test_talker_config_mapping():
    cfg = parse_deploy_config(mutated(
        (("stages", 0, "max_num_seqs"), 12),
        (("stages", 0, "compilation_config", "cudagraph_capture_sizes"), [12, 3, 1, 4]),
        (("stages", 0, "max_model_len"), 4096), (("stages", 0, "max_num_batched_tokens"), 513),
        (("stages", 0, "gpu_memory_utilization"), 0.5),
    ), SOURCE)
    assert cfg.talker_config() == TalkerConfig(12, 4096, 513, (4, 12), False, 0.5)
    eager = parse_deploy_config(mutated((("stages", 0, "enforce_eager"), True)), SOURCE)
    assert eager.talker_config().enforce_eager is True
    no_graphs = parse_deploy_config(mutated((("stages", 0, "compilation_config", "cudagraph_mode"), "NONE")), SOURCE)
    assert no_graphs.talker_config().enforce_eager is True


@pytest.mark.parametrize(
    "changes",
    [
        [(("stages", 0, "devices"), 0), (("stages", 1, "devices"), "  0 ")],  # int shorthand, spaces
        [(("stages", 0, "gpu_memory_utilization"), 1), (("stages", 1, "gpu_memory_utilization"), 1.0),
         (("stages", 1, "devices"), "1")],  # full cards: different GPUs
        [(("stages", 0, "gpu_memory_utilization"), 0.7), (("stages", 1, "gpu_memory_utilization"), 0.3)],
        [(("stages", 0, "enforce_eager"), True), (("stages", 0, "compilation_config", "cudagraph_capture_sizes"), [1])],
        [(("stages", 0, "compilation_config", "cudagraph_capture_sizes"), []),
         (("stages", 0, "compilation_config", "cudagraph_mode"), "NONE")],
        [(("stages", 0, "compilation_config", "custom_ops"), [])],
        [(("stages", 0, "dtype"), "float32"), (("stages", 1, "dtype"), "bfloat16")],
        [(("stages", 0, "max_model_len"), 1000), (("stages", 1, "max_model_len"), 9),
         (("stages", 1, "default_sampling_params", "max_tokens"), 9)],  # 999 frames: 9 windows
        [(("stages", 0, "max_model_len"), 11)],  # the shortest prompt (10 tokens) and one frame
        [(("stages", 0, "default_sampling_params", "seed"), 2**64 - 1)],
        [(("stages", 0, "default_sampling_params", "temperature"), 1),
         (("stages", 1, "default_sampling_params", "temperature"), 0)],
        [(("trust_remote_code",), True), (("async_chunk",), False),
         (("connectors", "connector_of_shared_memory", "extra", "codec_streaming"), False)],
        [(("stages", 0, "max_num_seqs"), MAX_NUM_SEQS), (("stages", 1, "max_num_seqs"), MAX_NUM_SEQS),
         (("stages", 0, "max_num_batched_tokens"), MAX_NUM_BATCHED_TOKENS),
         (("stages", 1, "max_num_batched_tokens"), MAX_NUM_BATCHED_TOKENS)],  # the sanity bounds themselves
        [(("connectors", "connector_of_shared_memory", "extra", "connector_get_max_wait"), MAX_WAIT_MS),
         (("connectors", "connector_of_shared_memory", "extra", "connector_get_max_wait_first_chunk"), MAX_WAIT_MS),
         (("connectors", "connector_of_shared_memory", "extra", "connector_get_sleep_s"), MIN_SLEEP_S)],
        [(("stages", 0, "devices"), "0007"), (("stages", 1, "devices"), MAX_GPU_INDEX)],
        # the lower bounds: everything in shared memory, waits of 1 ms, and a poll as long as the shorter wait
        [(("connectors", "connector_of_shared_memory", "extra", "shm_threshold_bytes"), 0),
         (("connectors", "connector_of_shared_memory", "extra", "connector_get_max_wait_first_chunk"), 1),
         (("connectors", "connector_of_shared_memory", "extra", "connector_get_max_wait"), 1),
         (("connectors", "connector_of_shared_memory", "extra", "connector_get_sleep_s"), 0.001)],
        # stage 1's sizes count windows, not cond/uncond rows: odd sizes alone are fine there
        [(("stages", 1, "compilation_config", "cudagraph_capture_sizes"), [1, 3])],
    ],
)
def test_accepted_variants(changes):
    parse_deploy_config(mutated(*changes), SOURCE)



def test_render_batch_is_capped_by_max_num_batched_tokens():
    """A render call takes one window per song and at most max_num_batched_tokens windows: min of the two."""
    changes = (S1 + ("max_num_batched_tokens",), 2), (C1 + ("cudagraph_capture_sizes",), [1, 2])
    cfg = parse_deploy_config(mutated(*changes), SOURCE)
    assert (cfg.stages[1].max_num_seqs, cfg.stages[1].render_batch) == (8, 2)
    assert Stage1Config(max_num_seqs=2, max_num_batched_tokens=8).render_batch == 2


@pytest.mark.parametrize("s0_len, s1_len, refused", [(1010, 9, False), (1010, 8, True), (1011, 9, True),
                                                     (1011, 10, False)])
def test_stage1_max_model_len_bound_follows_stage0s_longest_song(s0_len, s1_len, refused):
    """Stage 0's longest song is max_model_len - 10 frames (the shortest prompt is 10 tokens): 1010 gives 1000
    frames, 9 windows; 1011 gives 1001 frames, 10 windows. Stage 1's max_model_len must hold them."""
    data = mutated((S0 + ("max_model_len",), s0_len), (S1 + ("max_model_len",), s1_len))
    if not refused:
        assert parse_deploy_config(data, SOURCE).stages[1].max_model_len == s1_len
        return
    with pytest.raises(ConfigError) as info:
        parse_deploy_config(data, SOURCE)
    assert str(info.value).startswith(f"{SOURCE}: stages[1].max_model_len: got {s1_len}"), str(info.value)
    assert f">= {s1_len + 1} (windows of the longest song stage 0 can write: {s0_len - 10} frames)" in str(info.value)

# Refusals: each names the file, the key path, the value and what is allowed.
S0, S1 = ("stages", 0), ("stages", 1)
C0, C1 = S0 + ("compilation_config",), S1 + ("compilation_config",)
P0, P1 = S0 + ("default_sampling_params",), S1 + ("default_sampling_params",)
EXTRA = ("connectors", "connector_of_shared_memory", "extra")
INVALID: list[tuple[tuple, Any]] = [
    (("pipeline",), "minimax_music2"), (("pipeline",), 3),
    (("async_chunk",), 1), (("async_chunk",), "yes"), (("trust_remote_code",), "true"), (("trust_remote_code",), None),
    (("connectors",), []), (("connectors",), {}), (("connectors", "connector_of_shared_memory"), "shm"),
    (("connectors", "connector_of_shared_memory", "name"), "ZmqConnector"),
    (("connectors", "connector_of_shared_memory", "extra"), None),
    (EXTRA + ("codec_streaming",), 1), (EXTRA + ("shm_threshold_bytes",), -1), (EXTRA + ("shm_threshold_bytes",), True),
    (EXTRA + ("shm_threshold_bytes",), 1.5), (EXTRA + ("connector_get_sleep_s",), 0),
    (EXTRA + ("connector_get_sleep_s",), True), (EXTRA + ("connector_get_sleep_s",), "0.01"),
    (EXTRA + ("connector_get_sleep_s",), 11), (EXTRA + ("connector_get_sleep_s",), float("nan")),
    (EXTRA + ("connector_get_max_wait_first_chunk",), 0), (EXTRA + ("connector_get_max_wait_first_chunk",), 1.5),
    (EXTRA + ("connector_get_max_wait_first_chunk",), True), (EXTRA + ("connector_get_max_wait",), 0),
    (EXTRA + ("connector_get_max_wait_first_chunk",), MAX_WAIT_MS + 1), (EXTRA + ("connector_get_max_wait",), 10**20),
    (EXTRA + ("connector_get_max_wait",), MAX_WAIT_MS + 1),
    (EXTRA + ("connector_get_sleep_s",), 1e-5), (EXTRA + ("connector_get_sleep_s",), 1e-300),
    (("stages",), {}), (("stages", 0), 5),
    (S0 + ("stage_id",), 2), (S0 + ("stage_id",), True), (S0 + ("stage_id",), "0"), (S1 + ("stage_id",), 0),
    (S0 + ("max_num_seqs",), 15), (S0 + ("max_num_seqs",), 0), (S0 + ("max_num_seqs",), True),
    (S0 + ("max_num_seqs",), 16.0), (S1 + ("max_num_seqs",), 0), (S1 + ("max_num_seqs",), True),
    (S0 + ("max_num_seqs",), MAX_NUM_SEQS + 2), (S1 + ("max_num_seqs",), MAX_NUM_SEQS + 1),
    (S1 + ("max_num_seqs",), 30_000_000), (S1 + ("max_num_seqs",), 10**20),  # the default capture sizes count to it
    (S0 + ("gpu_memory_utilization",), 0), (S0 + ("gpu_memory_utilization",), 1.5),
    (S0 + ("gpu_memory_utilization",), True), (S0 + ("gpu_memory_utilization",), "0.6"),
    (S1 + ("gpu_memory_utilization",), -0.1), (S1 + ("gpu_memory_utilization",), 0.41),  # 0.6 + 0.41 on GPU 0
    (S0 + ("dtype",), "float16"), (S0 + ("dtype",), None), (S1 + ("dtype",), "int8"),
    (S0 + ("max_model_len",), 10241), (S0 + ("max_model_len",), 10), (S0 + ("max_model_len",), True),
    (S1 + ("max_model_len",), 88), (S1 + ("max_model_len",), "4096"),
    (S0 + ("max_num_batched_tokens",), 1), (S0 + ("max_num_batched_tokens",), False),
    (S1 + ("max_num_batched_tokens",), 0), (S0 + ("max_num_batched_tokens",), MAX_NUM_BATCHED_TOKENS + 1),
    (S1 + ("max_num_batched_tokens",), 10**20),
    (S0 + ("enforce_eager",), "false"), (S1 + ("enforce_eager",), 0),
    (C0, []), (C0 + ("mode",), 3), (C0 + ("mode",), False), (C0 + ("mode",), "0"), (C1 + ("mode",), 1),
    (C0 + ("cudagraph_capture_sizes",), [0, 2]), (C0 + ("cudagraph_capture_sizes",), [2, 32]),
    (C0 + ("cudagraph_capture_sizes",), [2, 2]), (C0 + ("cudagraph_capture_sizes",), "2,4"),
    (C0 + ("cudagraph_capture_sizes",), [2, True]), (C0 + ("cudagraph_capture_sizes",), [1]),
    (C0 + ("cudagraph_capture_sizes",), None), (C1 + ("cudagraph_capture_sizes",), [16]),
    (C0 + ("cudagraph_mode",), "FULL"), (C0 + ("cudagraph_mode",), "PIECEWISE"),
    (C0 + ("cudagraph_mode",), "full_decode_only"), (C1 + ("cudagraph_mode",), "FULL_AND_PIECEWISE"),
    (C0 + ("cudagraph_num_of_warmups",), 0), (C0 + ("cudagraph_num_of_warmups",), 2),
    (C0 + ("cudagraph_num_of_warmups",), True),
    (C0 + ("custom_ops",), ["none"]), (C0 + ("custom_ops",), ["+rms_norm"]), (C0 + ("custom_ops",), "all"),
    (C0 + ("custom_ops",), ["all", "all"]),
    (S0 + ("async_scheduling",), True), (S1 + ("async_scheduling",), True), (S0 + ("async_scheduling",), "no"),
    (S0 + ("enable_prefix_caching",), True), (S1 + ("enable_prefix_caching",), True),
    (S0 + ("devices",), "0,1"), (S0 + ("devices",), "a"), (S0 + ("devices",), -1), (S0 + ("devices",), "-1"),
    (S0 + ("devices",), True), (S0 + ("devices",), 1.5), (S0 + ("devices",), ""), (S1 + ("devices",), ["0"]),
    (S0 + ("devices",), "1024"), (S0 + ("devices",), 1024), (S0 + ("devices",), "0,"), (S0 + ("devices",), "\u0661"),
    (S0 + ("output_connectors",), "shm"), (S0 + ("output_connectors", "to_stage_1"), "nope"),
    (S1 + ("input_connectors", "from_stage_0"), "nope"), (S1 + ("input_connectors", "from_stage_0"), None),
    (P0, None), (P0 + ("temperature",), 0.7), (P0 + ("temperature",), True), (P0 + ("temperature",), "1.0"),
    (P0 + ("max_tokens",), contract.MAX_FRAMES), (P0 + ("max_tokens",), True),
    (P0 + ("seed",), -1), (P0 + ("seed",), 2**64), (P0 + ("seed",), True), (P0 + ("seed",), 1.5),
    (P0 + ("extra_args", "cfg_role"), "uncond"), (P0 + ("extra_args", "cfg_scale"), 2.0),
    (P0 + ("extra_args", "cfg_scale"), True), (P0 + ("extra_args",), "cond"),
    (P1 + ("temperature",), 1.0), (P1 + ("max_tokens",), 88), (P1 + ("seed",), "0"),
    (P1 + ("seed",), 7), (P1 + ("seed",), 1), (P1 + ("seed",), None), (P1 + ("seed",), False),
]
UNKNOWN: list[tuple] = [
    (), ("connectors", "connector_of_shared_memory"), EXTRA, S0, S1, C0, C1, P0, P1, P0 + ("extra_args",),
    S0 + ("output_connectors",), S1 + ("input_connectors",),
]


@pytest.mark.parametrize("path, value", INVALID, ids=[f"{path_text(p)}={v!r}" for p, v in INVALID])
def test_invalid_value(path, value):
    with pytest.raises(ConfigError) as info:
        parse_deploy_config(mutated((path, value)), SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}: {path_text(path)}: "), message
    assert f"got {yaml_spelled(value)}" in message and "allowed: " in message, message


def yaml_spelled(value: object) -> str:
    """A value as the message quotes it: YAML's words for true, false, null and not-a-number, else its repr."""
    if isinstance(value, list):
        return f"[{', '.join(map(yaml_spelled, value))}]"
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    return next((word for word, v in (("true", True), ("false", False), ("null", None)) if value is v), repr(value))


def test_values_are_quoted_as_yaml_spells_them():
    for value, said in ((True, "got true"), (None, "got null"), ([False, None], "got [false, null]"),
                        (float("inf"), "got .inf"), (float("-inf"), "got -.inf"), (float("nan"), "got .nan")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            parse_deploy_config(mutated((S0 + ("gpu_memory_utilization",), value)), SOURCE)


@pytest.mark.parametrize("where", UNKNOWN, ids=[path_text(p) or "<top>" for p in UNKNOWN])
def test_unknown_key_at_every_level(where):
    with pytest.raises(ConfigError, match="unknown key") as info:
        parse_deploy_config(mutated((where + ("foo",), 1)), SOURCE)
    assert str(info.value).startswith(f"{SOURCE}: {path_text(where + ('foo',))}: "), str(info.value)


@pytest.mark.parametrize(
    "changes, path, says",
    [
        ([(S0 + ("input_connectors",), {})], "stages[0].input_connectors", "only stage 1 has input_connectors"),
        ([(S1 + ("output_connectors",), {})], "stages[1].output_connectors", "the last stage"),
        ([(P1 + ("extra_args",), {})], "stages[1].default_sampling_params.extra_args", "only stage 0"),
        ([(P0 + ("top_k",), 50)], "stages[0].default_sampling_params.top_k", "unknown key"),
        ([(S0 + ("stage_id",), DELETE)], "stages[0].stage_id", "missing"),
        ([(("stages",), [{"stage_id": 0, "max_num_seqs": 15}])], "stages[0].max_num_seqs", "an even integer"),
        ([(("stages",), [{"stage_id": 0, "gpu_memory_utilization": 0.9}])], "stages[0].gpu_memory_utilization",
         "sum over the stages on GPU 0 <= 1 (it is 1.1; stage 1, not listed, takes its default 0.2)"),
        ([(("stages",), [{"stage_id": 1, "input_connectors": {"from_stage_0": "elsewhere"}}])],
         "stages[0].input_connectors.from_stage_0", "a connector defined under connectors"),
        ([(("stages",), BASE["stages"] + [{"stage_id": 1}])], "stages[2].stage_id", "exactly once"),
        ([(("connectors", "other"), {}), (S1 + ("input_connectors", "from_stage_0"), "other")],
         "stages[1].input_connectors.from_stage_0", "the connector stage 0 writes to (stages[0].output_connectors"),
        ([(("connectors",), {"shm2": {}})], "stages[0].output_connectors.to_stage_1", "shm2"),
        ([(S0 + ("max_model_len",), 1000), (S1 + ("max_model_len",), 8)], "stages[1].max_model_len", ">= 9"),
        ([(S1 + ("max_num_batched_tokens",), 2), (C1 + ("cudagraph_capture_sizes",), [4])],
         "stages[1].compilation_config.cudagraph_capture_sizes", "min(max_num_seqs, max_num_batched_tokens) = 2"),
        ([(C0 + ("cudagraph_capture_sizes",), [1, 3])], "stages[0].compilation_config.cudagraph_capture_sizes",
         "at least one even size"),
        ([(C0 + ("cudagraph_mode",), "FULL")], "stages[0].compilation_config.cudagraph_mode", "refused: prefill"),
        ([(C0 + ("mode",), 3)], "stages[0].compilation_config.mode", "refused: nothing is compiled"),
        ([(S0 + ("async_scheduling",), True)], "stages[0].async_scheduling", "cond/uncond pair must be sampled"),
        ([(S0 + ("enable_prefix_caching",), True)], "stages[0].enable_prefix_caching", "static slot per song pair"),
        ([(S1 + ("async_scheduling",), True)], "stages[1].async_scheduling", "its overlap carry handed to the song's"),
        ([(S1 + ("enable_prefix_caching",), True)], "stages[1].enable_prefix_caching", "stage 1 has no KV cache"),
        ([(EXTRA + ("connector_get_max_wait",), 5)], path_text(EXTRA + ("connector_get_sleep_s",)),
         "[0.0001, 0.005]: a poll must fit in the shorter max wait, and a shorter one only spins a CPU core"),
        ([(P1 + ("seed",), 7)], "stages[1].default_sampling_params.seed", "DiT noise is keyed by the song's seed"),
        ([(("connectors", "spare"), {"name": "SharedMemoryConnector"})], "connectors.spare",
         "unused: no stage writes to or reads from it; allowed: only the connector the stages use, "
         "'connector_of_shared_memory' (stages[0].output_connectors.to_stage_1)"),
        ([(("connectors", "other"), {}), (S0 + ("output_connectors", "to_stage_1"), "other"),
          (S1 + ("input_connectors", "from_stage_0"), "other")], "connectors.connector_of_shared_memory", "unused"),
        ([(S0 + ("devices",), "0, 1")], "stages[0].devices", "one GPU index (each stage runs on one GPU"),
        ([(S0 + ("quantization",), "int8")], "stages[0].quantization", "none or fp8 (fp8: e4m3 weights"),
        ([(S1 + ("quantization",), "fp4")], "stages[1].quantization", "none or fp8 (fp8: the DiT blocks'"),
        ([(S0 + ("dtype",), "float32"), (S0 + ("quantization",), "fp8")], "stages[0].dtype",
         "allowed: bfloat16 with quantization: fp8 (the FP8 decode kernel takes bf16 activations)"),
        ([(S1 + ("gpu_memory_utilization",), 0.5)], "stages[1].gpu_memory_utilization", "sum over the stages on GPU 0"),
        ([(("connectors",), {" ": {}}), (S0 + ("output_connectors", "to_stage_1"), " "),
          (S1 + ("input_connectors", "from_stage_0"), " ")], "connectors",
         "got ' '; allowed: connector names that are non-empty strings"),
    ],
)
def test_cross_checks_and_hints(changes, path, says):
    with pytest.raises(ConfigError) as info:
        parse_deploy_config(mutated(*changes), SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}: {path}: ") and says in message, message


# The file itself.
@pytest.mark.parametrize(
    "text, says",
    [
        ("pipeline: [minimax_music3\n", "not valid YAML"),
        ("stages:\n  - stage_id: 0\n   max_num_seqs: 4\n", "not valid YAML"),
        ("pipeline: minimax_music3\npipeline: minimax_music3\n", "duplicate key 'pipeline'"),
        ("stages:\n  - {stage_id: 0, stage_id: 1}\n", "duplicate key 'stage_id'"),
        ("- stage_id: 0\n", "<top level>: got [{'stage_id': 0}]; allowed: a mapping"),
        ("just text\n", "<top level>: got 'just text'"),
        ("", "<top level>: got null"),
        ("pipeline: !!python/object:os.system x\n", "not valid YAML"),
        ("stages: [{stage_id: 0, max_num_seqs: 1" + "0" * 5000 + "}]\n", "as !!int (Exceeds the limit (4300 digits)"),
        ("pipeline: a\x01b\n", "unacceptable character #x0001"),
        # numbers not in plain decimal, in lists and keys too
        ("stages:\n  - stage_id: 0\n    compilation_config: {cudagraph_capture_sizes: [2, 010]}\n",
         "stages[0].compilation_config.cudagraph_capture_sizes[1]: '010' has a leading zero"),
        ("0x10: 1\n", "'0x10' is written in hexadecimal"),  # a key
        ("stages: [{stage_id: 0, default_sampling_params: {seed: 1_000}}]\n",
         "stages[0].default_sampling_params.seed: '1_000' has '_' in it"),
    ],
)
def test_file_errors_name_the_file(tmp_path, text, says):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    assert str(info.value).startswith(f"{path}: ") and says in str(info.value), str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the deploy config") as info:
        load_deploy_config(tmp_path / "absent.yaml")
    assert isinstance(info.value, ValueError) and isinstance(info.value, Music3Error)
    assert str(tmp_path / "absent.yaml") in str(info.value)


@pytest.mark.parametrize(
    "path, says",
    [
        ("", "'' (an empty path): cannot read the deploy config: the path is empty"),  # not the package, not "."
        ("a\0b.yaml", "a\0b.yaml: cannot read the deploy config: embedded null byte"),
    ],
)
def test_paths_that_name_no_file(path, says):
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    assert str(info.value).startswith(says), str(info.value)


@pytest.mark.parametrize(
    "text, says",
    [
        ("async_chunk: !!bool maybe\n", "async_chunk: not valid YAML: cannot read 'maybe' as !!bool"),
        ("pipeline: !!timestamp foo\n", "pipeline: not valid YAML: cannot read 'foo' as !!timestamp"),
        ("pipeline: 2001-13-45\n", "pipeline: not valid YAML: cannot read '2001-13-45' as !!timestamp (month must"),
        ('stages: [{stage_id: !!int ""}, {stage_id: 1}]\n', "stages[0].stage_id: not valid YAML: cannot read '' as "
         "!!int"),
        ('stages:\n  - stage_id: 0\n    gpu_memory_utilization: !!float ""\n',
         "stages[0].gpu_memory_utilization: not valid YAML: cannot read '' as !!float"),
        ("connectors: !!map [x]\n", "connectors: not valid YAML: expected a mapping node, but found sequence"),
        ("connectors: !!map abc\n", "connectors: not valid YAML: expected a mapping node, but found scalar"),
        ("stages: [{stage_id: 0, stage_id: 1}]\n", "stages[0]: not valid YAML: duplicate key 'stage_id'"),
        ("pipeline: " + "{a: " * 300 + "1" + "}" * 300 + "\n",
         "not valid YAML: nested deeper than 32 levels (at pipeline.a.a.a."),
        ("pipeline: " + "[" * 2000 + "]" * 2000 + "\n",
         "not valid YAML: nested deeper than 32 levels (at pipeline[0][0][0]"),
    ],
)
def test_yaml_that_cannot_be_built_names_the_key_and_line(tmp_path, text, says):
    """PyYAML's own errors for these are KeyError, IndexError, AttributeError, TypeError or RecursionError."""
    path = tmp_path / "tags.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {says}") and f'in "{path}", line ' in message, message



def test_nesting_up_to_max_depth_is_read_and_one_level_more_is_refused(tmp_path):
    """32 levels, the top mapping and the innermost scalar counted, load; 33 are refused with the key path."""
    assert MAX_DEPTH == 32
    path = tmp_path / "deep.yaml"
    lists = MAX_DEPTH - 2  # top mapping + the lists + the scalar 1
    path.write_text("pipeline: " + "[" * lists + "1" + "]" * lists + "\n")
    data, _ = read_deploy_yaml(path)
    node = data["pipeline"]
    for _ in range(lists):
        (node,) = node
    assert node == 1
    path.write_text("pipeline: " + "[" * (lists + 1) + "1" + "]" * (lists + 1) + "\n")
    with pytest.raises(ConfigError, match=r"nested deeper than 32 levels \(at pipeline" + r"\[0\]" * lists + r"\)"):
        read_deploy_yaml(path)

def alias_bomb(levels: int) -> str:
    """A list of 9**levels strings in a few hundred bytes: each level is nine aliases of the one below."""
    rows = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    rows += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(rows) + "]"


@pytest.mark.parametrize(
    "template, path",
    [
        ("{}\n", "<top level>"),
        ("pipeline: {}\n", "pipeline"),
        ("stages: [{}, {{stage_id: 1}}]\n", "stages[0]"),
        ("stages: [{{stage_id: 0, compilation_config: {{cudagraph_capture_sizes: {}}}}}, {{stage_id: 1}}]\n",
         "stages[0].compilation_config.cudagraph_capture_sizes"),
    ],
)
def test_an_alias_bomb_is_refused_at_once(tmp_path, template, path):
    """The refusal quotes the value cut short, without building its full repr (9**9 strings)."""
    file = tmp_path / "bomb.yaml"
    file.write_text(template.format(alias_bomb(9)))
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        load_deploy_config(file)
    assert time.perf_counter() - start < 1.0
    message = str(info.value)
    assert message.startswith(f"{file}: {path}: got [['lol', 'lol'") and len(message) < 1000, message


def test_merges_of_merges_do_not_multiply(tmp_path):
    """Nine levels of mappings, each merging nine aliases of the one below: PyYAML before 6.0.4 copied the merged
    pairs once per alias, 9**9 of them at the top."""
    rows = ["x0: &m0 {a: 1, b: 2}"] + [f"x{i}: &m{i} {{<<: [" + ", ".join([f"*m{i - 1}"] * 9) + "]}"
                                       for i in range(1, 10)]
    file = tmp_path / "merges.yaml"
    file.write_text("\n".join(rows) + "\n")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="x0: unknown key"):
        load_deploy_config(file)
    assert time.perf_counter() - start < 1.0


HUGE = 10**400  # float() of it overflows


@pytest.mark.parametrize(
    "changes, path",
    [
        ([(S0 + ("gpu_memory_utilization",), HUGE)], "stages[0].gpu_memory_utilization"),
        ([(P0 + ("temperature",), HUGE)], "stages[0].default_sampling_params.temperature"),
        ([(P0 + ("extra_args", "cfg_scale"), HUGE)], "stages[0].default_sampling_params.extra_args.cfg_scale"),
        ([(EXTRA + ("connector_get_sleep_s",), HUGE)], path_text(EXTRA + ("connector_get_sleep_s",))),
        ([(EXTRA + ("connector_get_max_wait_first_chunk",), HUGE), (EXTRA + ("connector_get_max_wait",), HUGE)],
         path_text(EXTRA + ("connector_get_max_wait_first_chunk",))),
        ([(S0 + ("devices",), HUGE)], "stages[0].devices"),
        ([(S0 + ("devices",), "1" * 4400)], "stages[0].devices"),  # int() refuses over 4300 digits
        ([(S0 + ("devices",), 2**16000)], "stages[0].devices"),  # str() refuses it too (devices: 0xfff...)
        ([((2**16000,), 1)], "<an integer of about 4817 digits>"),  # an unknown key: str() refuses it too
    ],
)
def test_huge_values_are_refused_and_quoted_short(changes, path):
    with pytest.raises(ConfigError) as info:
        parse_deploy_config(mutated(*changes), SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}: {path}: ") and len(message) < 600, message


@pytest.mark.parametrize(
    "text, says",
    [
        ("stages: [{<<: {stage_id: 0, max_num_seqs: 4, max_num_seqs: 6}}, {stage_id: 1}]\n",
         "duplicate key 'max_num_seqs'"),
        ("a: &a {stage_id: 0}\nb: &b {max_num_seqs: 4}\nstages: [{<<: *a, <<: *b}, {stage_id: 1}]\n",
         "duplicate key '<<'"),
    ],
)
def test_keys_written_twice_in_a_merged_mapping_or_merge_keys_written_twice_are_refused(tmp_path, text, says):
    """PyYAML merges a mapping's pairs without constructing it, so its keys went unchecked; and of two merge keys in
    one mapping it kept the last."""
    path = tmp_path / "merged.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says):
        load_deploy_config(path)


def test_a_config_past_its_size_limit_is_refused_after_reading_at_most_one_byte_more(tmp_path, monkeypatch):
    """--config /dev/zero grew to 22 GB before the kernel killed the process; a 200 MB file of comments parsed for
    minutes."""
    from music3serve.serving import deploy_yaml

    with pytest.raises(ConfigError, match=r"over 1048576 bytes"):
        load_deploy_config("/dev/zero")
    monkeypatch.setattr(deploy_yaml, "MAX_CONFIG_BYTES", 100)
    path = tmp_path / "long.yaml"
    path.write_text("# " + "x" * 98 + "\n")
    with pytest.raises(ConfigError, match=r"long\.yaml: the deploy config is over 100 bytes"):
        load_deploy_config(path)
    text = "pipeline: minimax_music3\n# "  # exactly the limit is read
    path.write_text(text + "x" * (99 - len(text)) + "\n")
    assert path.stat().st_size == 100 and load_deploy_config(path) == DeployConfig()


def test_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "anchors.yaml"
    text = "stages:\n  - &s {stage_id: 0, max_num_seqs: 4}\n  - <<: *s\n    stage_id: 1\n    max_num_seqs: 2\n"
    path.write_text(text)
    cfg = load_deploy_config(path)
    assert (cfg.stages[0].max_num_seqs, cfg.stages[1].max_num_seqs) == (4, 2)


def test_a_mapping_that_overrides_a_merged_key_can_be_merged_again():
    """Once flattened, a mapping holds the merged key beside the one overriding it: only its pairs as written count,
    and the document reads as PyYAML's own loader reads it."""
    from music3serve.serving.deploy_yaml import _Loader

    text = "a: &a {x: 1}\nb: &b {<<: *a, x: 2}\nc: {<<: *b, y: 3}\n"
    loader = _Loader(text, "t")
    try:
        data = loader.get_single_data()
    finally:
        loader.dispose()
    assert data == yaml.safe_load(text) and data["b"] == {"x": 2} and data["c"]["y"] == 3


def test_a_number_yaml_reads_as_text_says_how_to_write_it():
    """YAML 1.1 reads 5e-1 (no dot) as a string: the error says so and gives the number to write."""
    with pytest.raises(ConfigError, match=r"'5e-1' was read as text: write it with a dot, as 0\.5"):
        parse_deploy_config(mutated((S1 + ("gpu_memory_utilization",), "5e-1")), SOURCE)


# Numbers in YAML 1.1's other notations: read silently as something else (010 as 8, 1:30 as 90), so refused.
TWO_STAGES = "stages:\n  - stage_id: 0\n    {key}: {value}\n  - stage_id: 1\n"


NOT_DECIMAL = [
    ("max_num_seqs", "010", "'010' has a leading zero, so YAML 1.1 reads it as 8 (octal): write integers in decimal, "
     "without leading zeros"),
    ("max_num_seqs", "-010", "'-010' has a leading zero, so YAML 1.1 reads it as -8 (octal)"),
    ("max_num_seqs", "00", "'00' has a leading zero, so YAML 1.1 reads it as 0 (octal)"),
    ("max_num_batched_tokens", "1:30", "'1:30' is written in base 60 (YAML 1.1 reads it as 90): write integers in "
     "decimal\n"),
    ("max_num_seqs", "0x10", "'0x10' is written in hexadecimal (YAML 1.1 reads it as 16): write integers in "
     "decimal, as 16"),
    ("max_num_seqs", "0b100", "'0b100' is written in binary (YAML 1.1 reads it as 4): write integers in decimal, "
     "as 4"),
    ("max_num_batched_tokens", "10_240", "'10_240' has '_' in it (YAML 1.1 reads it as 10240): write integers in "
     "decimal, as 10240"),
    ("max_num_seqs", "+4", "'+4' has a '+' sign: write integers in decimal, as 4"),
    ("max_num_seqs", '!!int "0x10"', "'0x10' is written in hexadecimal"),  # an explicit tag reads it too
    ("max_num_seqs", '!!int " 4"', "' 4' is not written in plain decimal (YAML 1.1 reads it as 4): write "
     "integers in decimal, as 4"),
    ("max_num_seqs", "0x" + "f" * 200, "is written in hexadecimal (YAML 1.1 reads it as <an integer of about 241 "
     "digits>): write integers in decimal\n"),
    ("gpu_memory_utilization", "0:30.5", "'0:30.5' is written in base 60 (YAML 1.1 reads it as 30.5): write "
     "numbers in decimal\n"),
    ("gpu_memory_utilization", "0.000_5", "'0.000_5' has '_' in it (YAML 1.1 reads it as 0.0005): write numbers "
     "in decimal, as 0.0005"),
    ("gpu_memory_utilization", ".5", "'.5' has no digit before its dot: write numbers in decimal, as 0.5"),
    ("gpu_memory_utilization", "1.", "'1.' has no digit after its dot: write numbers in decimal, as 1.0"),
    ("gpu_memory_utilization", "+0.5", "'+0.5' has a '+' sign: write numbers in decimal, as 0.5"),
    ("gpu_memory_utilization", "00.5", "'00.5' has a leading zero: write numbers in decimal, as 0.5"),
    ("gpu_memory_utilization", "1_0.0e+300", "as 1.0e+301"),  # a float YAML 1.1 reads back (repr: 1e+301)
    ("gpu_memory_utilization", "!!float Infinity", "'Infinity' is not written in plain decimal (YAML 1.1 reads "
     "it as .inf): write numbers in decimal\n"),
]


@pytest.mark.parametrize("key, value, says", NOT_DECIMAL, ids=[f"{k}={v[:12]}" for k, v, _ in NOT_DECIMAL])
def test_numbers_not_written_in_plain_decimal_are_refused(tmp_path, key, value, says):
    path = tmp_path / "deploy.yaml"
    path.write_text(TWO_STAGES.format(key=key, value=value))
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: stages[0].{key}: ") and says in message, message
    assert "not valid YAML" not in message and f'in "{path}", line 3, column ' in message, message


def test_plain_decimal_numbers_and_quoted_strings_load_as_written(tmp_path):
    path = tmp_path / "numbers.yaml"
    path.write_text("ints: [0, -0, 7, 10, -1, 10240, 123456789012345678901234567890]\n"
                    "floats: [0.0, -0.0, 1.0, 0.6, 0.01, -2.5, 1.0e-3, 1.5E+10, 2.0e-300, .inf, -.inf]\n"
                    "tagged: [!!float 1e-3, !!float 5, !!int 12]\n"
                    "strings: ['010', \"0x10\", '1:30', '+5', '10_240', \".5\", '1.', 0o10, 09, 1e-3, -.5]\n")
    data, _ = read_deploy_yaml(path)
    assert data == yaml.safe_load(path.read_text()) == {
        "ints": [0, 0, 7, 10, -1, 10240, 123456789012345678901234567890],
        "floats": [0.0, -0.0, 1.0, 0.6, 0.01, -2.5, 0.001, 1.5e10, 2e-300, math.inf, -math.inf],
        "tagged": [0.001, 5.0, 12],
        "strings": ["010", "0x10", "1:30", "+5", "10_240", ".5", "1.", "0o10", "09", "1e-3", "-.5"],
    }
    assert [type(v) for v in data["ints"] + data["floats"]] == [int] * 7 + [float] * 11


@pytest.mark.parametrize("path", [None, EXAMPLE], ids=["default", "example"])
def test_the_shipped_default_and_the_example_read_as_plain_yaml_reads_them(path):
    default = resources.files("music3serve.serving").joinpath("default_deploy.yaml")
    text = (path or default).read_text(encoding="utf-8")
    data, _ = read_deploy_yaml(path)
    assert data == yaml.safe_load(text) and repr(data) == repr(yaml.safe_load(text))


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("max_num_seqs", "0o10", "got '0o10'; allowed: an even integer in [2, 1024] (rows: every song is a cond/uncond "
         "pair); '0o10' was read as text (YAML 1.1 has no 0o): write integers in decimal"),
        ("max_num_seqs", "09", "got '09'; allowed: an even integer in [2, 1024] (rows: every song is a cond/uncond "
         "pair); '09' was read as text (YAML 1.1 reads a leading zero as octal, and it is not): write integers in "
         "decimal, without leading zeros"),
        ("max_num_seqs", "'010'", "got '010'; allowed: an even integer in [2, 1024] (rows: every song is a "
         "cond/uncond pair)\n"),  # quoted on purpose: a string, no hint
        ("max_num_seqs", "-2", "got -2; allowed: an even integer in [2, 1024]"),  # decimal: the range check's turn
        ("gpu_memory_utilization", "-0.5", "got -0.5; allowed: a number in (0, 1]\n"),
        ("gpu_memory_utilization", "1e300", "'1e300' was read as text: write it with a dot, as 1.0e+300\n"),
        ("gpu_memory_utilization", "1.0e3", "'1.0e3' was read as text: write it with a sign in its exponent, as "
         "1000.0\n"),
        ("gpu_memory_utilization", "-.5", "'-.5' was read as text: write it in decimal, as -0.5\n"),
    ],
)
def test_numbers_yaml_reads_as_text_or_decimals_out_of_range_get_the_typed_reads_message(tmp_path, key, value, says):
    path = tmp_path / "deploy.yaml"
    path.write_text(TWO_STAGES.format(key=key, value=value))
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    message = str(info.value) + "\n"
    assert message.startswith(f"{path}: stages[0].{key}: ") and says in message, message


def test_plain_decimal_numbers_load_into_the_config(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("stages:\n  - stage_id: 0\n    max_num_seqs: 10\n    gpu_memory_utilization: 0.5\n"
                    "    compilation_config: {cudagraph_capture_sizes: [2, 10]}\n"
                    "    default_sampling_params: {seed: 0, temperature: 1.0}\n"
                    "  - {stage_id: 1, gpu_memory_utilization: 1.0e-1}\n"
                    "connectors:\n  connector_of_shared_memory:\n    name: SharedMemoryConnector\n"
                    "    extra: {connector_get_sleep_s: 1.0e-3}\n")
    cfg = load_deploy_config(path)
    s0, s1 = cfg.stages
    assert (s0.max_num_seqs, s0.gpu_memory_utilization, s0.compilation_config.cudagraph_capture_sizes) == (
        10, 0.5, (2, 10))
    assert (s0.default_sampling_params.seed, s1.gpu_memory_utilization) == (0, 0.1)
    assert cfg.connector.extra.connector_get_sleep_s == 0.001


@pytest.mark.parametrize("listed", [0, 1])
def test_a_stage_left_out_runs_where_the_listed_stage_runs(listed):
    """Moving the one stage a file lists moves the other with it: split placement only where a file asks for it."""
    listed_stage = {"stage_id": listed, "devices": "1", "gpu_memory_utilization": 0.2}
    deploy = parse_deploy_config({"stages": [listed_stage]}, SOURCE)
    assert [stage.devices for stage in deploy.stages] == [(1,), (1,)]
    both = parse_deploy_config({"stages": [{"stage_id": 0, "devices": "0"}, {"stage_id": 1, "devices": "1"}]}, SOURCE)
    assert [stage.devices for stage in both.stages] == [(0,), (1,)]

    with pytest.raises(ConfigError, match=r"\(it is 1.1; stage 0, not listed, takes its default 0.6\)"):
        parse_deploy_config({"stages": [{"stage_id": 1, "devices": "1", "gpu_memory_utilization": 0.5}]}, SOURCE)
