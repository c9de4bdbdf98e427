"""The checkpoint's JSON configs, read strictly: every value that would change the math we run is one we implement,
and every field of our configs holds a positive value of its type."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .errors import CheckpointError


class Supported(typing.NamedTuple):
    """The values of one config key that the code we run implements. absent: what the reference library reads where
    the key is missing, checked like a value found (Ellipsis: the first supported value, the library's default); each:
    the value is a list whose every item must be supported. A dotted key reads inside a JSON object."""

    values: tuple[Any, ...]
    absent: Any = ...
    each: bool = False


# torch_dtype / dtype are only a hint of how the weights were stored: each tensor's dtype is read from its safetensors
# header (refused unless one of WEIGHT_DTYPES) and cast to the dtype we run in, which the hint never chooses. So any
# float name leaves our math alone, and comparing it with the disk would only refuse working checkpoints; a name that
# is no float type would announce quantized weights, and is refused.
DTYPE_HINT = Supported(("bfloat16", "float16", "float32", "float64", None), absent=None)
ROPE_TYPE = Supported(("default",))  # plain rotary embeddings: no scaling (yarn, linear, dynamic, llama3, ...)

# Per component (and the scheduler), every config value that would change the math we run or name another
# architecture; a key not listed here is either read by the component's from_json or has no effect on inference.
SUPPORTED: dict[str, dict[str, Supported]] = {
    "language_model": {
        "model_type": Supported(("qwen3",)),
        "architectures": Supported(("Qwen3ForCausalLM",), each=True),
        "hidden_act": Supported(("silu",)),
        "attention_bias": Supported((False,)),
        "tie_word_embeddings": Supported((False,)),  # our head is lm_head.weight, a tensor of its own
        "use_sliding_window": Supported((False,)),
        "layer_types": Supported(("full_attention",), each=True),
        "rope_scaling.rope_type": ROPE_TYPE,
        "rope_scaling.type": ROPE_TYPE,
        "rope_parameters.rope_type": ROPE_TYPE,
        "rope_parameters.type": ROPE_TYPE,
        "quantization_config": Supported((None,)),
        "torch_dtype": DTYPE_HINT,
        "dtype": DTYPE_HINT,
    },
    "depth_decoder": {"_class_name": Supported(("MiniMaxMusic3RVQDepthDecoder",))},
    "condition_encoder": {"_class_name": Supported(("MiniMaxMusic3ConditionEncoder",))},
    "dit": {"_class_name": Supported(("MiniMaxMusic3Transformer1DModel",))},
    "vocoder": {"_class_name": Supported(("MiniMaxMusic3Vocoder",))},
    "scheduler": {
        "_class_name": Supported(("FlowMatchEulerDiscreteScheduler",)),
        "num_train_timesteps": Supported((1,), absent=1000),
        "shift": Supported((1.0,)),
        "invert_sigmas": Supported((True,), absent=False),
        "use_dynamic_shifting": Supported((False,)),
        "shift_terminal": Supported((None,)),
        "use_karras_sigmas": Supported((False,)),
        "use_exponential_sigmas": Supported((False,)),
        "use_beta_sigmas": Supported((False,)),
        "stochastic_sampling": Supported((False,)),
    },
}
_ABSENT = object()


def check_supported(path: Path, config: dict[str, Any], supported: dict[str, Supported]) -> None:
    """Every listed key of a config holds a value we implement (a missing one: the value the library reads for it),
    or a CheckpointError naming the file, the key, the value and what we support."""
    for key, want in supported.items():
        found = _lookup(path, config, key)
        value = (want.values[0] if want.absent is ... else want.absent) if found is _ABSENT else found
        items = value if want.each and isinstance(value, list) else [value]
        if not all(any(_same(item, ok) for ok in want.values) for item in items):
            shown = f"absent (read as {as_json(value)})" if found is _ABSENT else as_json(found)
            allowed = " or ".join(as_json(ok) for ok in want.values) + (" (each item)" if want.each else "")
            raise CheckpointError(f"{path}: {key} is {shown}, we support only {allowed}")


def _lookup(path: Path, config: dict[str, Any], key: str) -> Any:
    """config["a"]["b"] for the key "a.b"; _ABSENT where a level is missing or null."""
    value: Any = config
    for depth, part in enumerate(key.split(".")):
        if value is None:
            return _ABSENT
        if not isinstance(value, dict):
            outer = ".".join(key.split(".")[:depth])
            raise CheckpointError(f"{path}: '{outer}' must be a JSON object, got {as_json(value)}")
        if part not in value:
            return _ABSENT
        value = value[part]
    return value


def _same(found: Any, supported: Any) -> bool:
    """Equal, where a bool is no number (1 is not True, 0 is not False) and an int may stand for its float."""
    return isinstance(found, bool) == isinstance(supported, bool) and found == supported


def as_json(value: Any) -> str:
    """A config value as its file spells it (true, null, "text"), cut to 80 characters."""
    return json.dumps(value, default=repr)[:80]


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from disk, or a CheckpointError naming the file."""
    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8 or JSON, an integer of 5000 digits
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


@contextmanager
def config_values(path: Path) -> Iterator[None]:
    """What a config value of the wrong type or size raises as our configs and modules are built from it ("128"
    where a number belongs, a number where a list does) becomes a CheckpointError naming the config file."""
    try:
        yield
    except (TypeError, ValueError, ArithmeticError, RuntimeError) as exc:  # RuntimeError: sizes overflow int64
        raise CheckpointError(f"{path}: a value has the wrong type or size ({exc})") from exc


def checked_fields(config: Any, raw: dict[str, Any] | None = None) -> Any:
    """The config, once every field holds a positive value of its annotated type (int, float, or a tuple of ints):
    a value the model uses only when it generates ("8" for a rotary width) fails here, at load, not in the first
    song. A failure names the key of `raw` (the config.json it was read from) that holds the value."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        value, kind = getattr(config, field.name), hints[field.name]
        items = value if kind == tuple[int, ...] and isinstance(value, tuple) and value else [value]
        number = float if kind is float else int
        if not all(_positive(item, number) for item in items):
            wanted = f"a positive {number.__name__}" if kind is number else "a non-empty list of positive ints"
            raise CheckpointError(f"'{_json_key(raw or {}, field.name, value)}' must be {wanted}, got {as_json(value)}")
    return config


def _json_key(raw: dict[str, Any], field: str, value: Any) -> str:
    """The key of config.json that gave a field its value (hidden_size for hidden): the one holding that value (as JSON
    spells it), where several do the one that contains the field's name; else the field's own name."""
    keys = [key for key, found in raw.items() if as_json(found) == as_json(value)]
    named = [key for key in keys if field in key]
    return keys[0] if len(keys) == 1 else named[0] if len(named) == 1 else field


def _positive(value: Any, kind: type) -> bool:
    allowed = (int, float) if kind is float else (int,)
    return isinstance(value, allowed) and not isinstance(value, bool) and 0 < value < math.inf
