"""Reading the deploy YAML: a loader that refuses duplicate keys, and typed reads of one mapping at a time whose
errors name the file, the key path, the value and what is allowed."""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..errors import Music3Error
from .deploy_schema import SEED_LIMIT

_UNKNOWN_KEY_HINTS = {
    "input_connectors": " (stage 0 takes its requests from the API server; only stage 1 has input_connectors)",
    "output_connectors": " (stage 1 is the last stage: its PCM goes to the API server; only stage 0 has them)",
    "extra_args": " (only stage 0 has extra_args; stage 1's guidance is fixed by the checkpoint)",
}


class ConfigError(Music3Error, ValueError):
    """A deploy configuration that cannot be served as written."""


def read_deploy_yaml(path: Path | str | None) -> tuple[Any, str]:
    """The loaded document of a deploy YAML and the name errors give it; None reads default_deploy.yaml."""
    try:
        if path is None:
            resource = resources.files(__package__).joinpath("default_deploy.yaml")
            source, text = f"{resource} (built-in default)", resource.read_text(encoding="utf-8")
        else:
            source, text = str(path), Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path or __package__}: cannot read the deploy config: {exc}") from None
    try:
        return yaml.load(text, Loader=_Loader), source  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    except ValueError as exc:  # an integer past Python's digit limit for converting text
        raise ConfigError(f"{source}: a value cannot be read ({exc})") from None


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


def bad(source: str, path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{source}: {path}: got {value!r:.200}; allowed: {allowed}")


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float that is not a bool."""
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


class Section:
    """One mapping of the file: typed reads with defaults, after refusing keys not in `keys`."""

    def __init__(self, data: Any, path: str, source: str, keys: tuple[str, ...]):
        self.path, self.source = path, source
        if not isinstance(data, dict):
            raise bad(source, path or "<top level>", data, f"a mapping with the keys {', '.join(keys)}")
        for key in data:
            if key not in keys:
                hint = _UNKNOWN_KEY_HINTS.get(key, "") if isinstance(key, str) else ""
                raise ConfigError(f"{source}: {self.key(key)}: unknown key{hint}; allowed here: {', '.join(keys)}")
        self.data = data

    def key(self, key: Any) -> str:
        """The key's path from the top of the file."""
        return f"{self.path}.{key}" if self.path else str(key)

    def bad(self, key: str, value: Any, allowed: str) -> ConfigError:
        return bad(self.source, self.key(key), value, allowed)

    def sub(self, key: str, keys: tuple[str, ...]) -> Section:
        """The mapping under ``key`` (empty when missing), allowing ``keys``."""
        return Section(self.data.get(key, {}), self.key(key), self.source, keys)

    def bool(self, key: str, default: bool, refuse_true: str = "") -> bool:
        """True or false; with ``refuse_true``, only false (the reason given is ``refuse_true``)."""
        v = self.data.get(key, default)
        if not isinstance(v, bool) or (v and refuse_true):
            raise self.bad(key, v, f"false ({refuse_true})" if refuse_true else "true or false")
        return v

    def int(self, key: str, default: int, lo: int, hi: float = math.inf, allowed: str = "", even: bool = False) -> int:
        v = self.data.get(key, default)
        if not (is_int(v) and lo <= v <= hi and not (even and v % 2)):
            span = f"an integer >= {lo}" if hi == math.inf else f"an integer in [{lo}, {hi}]"
            raise self.bad(key, v, allowed or span)
        return v

    def number(self, key: str, default: float, ok: Any, allowed: str) -> float:
        """A finite number for which ``ok`` holds, as a float."""
        v = self.data.get(key, default)
        if not (is_number(v) and ok(v)):
            if isinstance(v, str) and _reads_as_number(v):  # YAML 1.1 takes 5e-1 (no dot) for text
                allowed += f"; {v!r} was read as text: write it with a dot, as {float(v)!r}"
            raise self.bad(key, v, allowed)
        return float(v)

    def choice(self, key: str, default: str, choices: tuple[str, ...], why: str = "", refused: dict | None = None
               ) -> str:
        """One of ``choices``; ``refused`` gives the reason some other known values cannot be honored."""
        v = self.data.get(key, default)
        if not (isinstance(v, str) and v in choices):
            reason = (refused or {}).get(v) if isinstance(v, str) else None
            why = f" ({why})" if why else ""
            raise self.bad(key, v, " or ".join(choices) + why + (f"; refused: {reason}" if reason else ""))
        return v

    def seed(self, key: str, default: int | None) -> int | None:
        v = self.data.get(key, default)
        if v is not None and not (is_int(v) and 0 <= v < SEED_LIMIT):
            raise self.bad(key, v, "null or an integer in [0, 2**63)")
        return v


def _reads_as_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
