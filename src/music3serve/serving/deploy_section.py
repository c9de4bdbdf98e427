"""Typed reads of one mapping of the deploy YAML at a time, with defaults: unknown keys, wrong types and values out
of range are refused with the file, the key path, the value and what is allowed."""

from __future__ import annotations

import math
import re
from typing import Any

from .deploy_errors import ConfigError, bad, quote
from .deploy_numbers import int_text_hint, reads_as_number, yaml_float
from .deploy_schema import SEED_LIMIT

_UNKNOWN_KEY_HINTS = {
    "input_connectors": " (stage 0 takes its requests from the API server; only stage 1 has input_connectors)",
    "output_connectors": " (stage 1 is the last stage: its PCM goes to the API server; only stage 0 has them)",
    "extra_args": " (only stage 0 has extra_args; stage 1's guidance is fixed by the checkpoint)",
}


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float that is not a bool."""
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))  # isfinite() overflows on a 400-digit int


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
        text = key if isinstance(key, str) else quote(key)  # str() refuses an int of over 4300 digits
        return f"{self.path}.{text}" if self.path else text

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
            raise self.bad(key, v, (allowed or span) + (int_text_hint(v) if isinstance(v, str) else ""))
        return v

    def number(self, key: str, default: float, ok: Any, allowed: str) -> float:
        """A finite number for which ``ok`` holds, as a float."""
        v = self.data.get(key, default)
        if not (is_number(v) and ok(v)):
            if isinstance(v, str) and reads_as_number(v):  # YAML 1.1 takes 5e-1 (no dot), 1.0e3 and -.5 for text
                how = ("with a dot" if "." not in v else "with a sign in its exponent" if re.search("[eE][0-9]", v)
                       else "in decimal")
                allowed += f"; {quote(v)} was read as text: write it {how}, as {yaml_float(float(v))}"
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
            raise self.bad(key, v, "null or an integer in [0, 2**64)")
        return v
