"""The deploy config's error, ConfigError, and the wording its messages share: a value quoted at a bounded length,
built without walking more of it than it shows."""

from __future__ import annotations

import math
import reprlib
from typing import Any

from ..errors import Music3Error


class ConfigError(Music3Error, ValueError):
    """A deploy configuration that cannot be served as written."""


class _Quote(reprlib.Repr):
    """repr() of a config value cut to a few hundred characters, built without walking more than it shows: anchors
    and aliases let a small file hold a list whose full repr would take gigabytes (a "billion laughs"). YAML's own
    words stand for what has one (true, false, null, .inf, .nan): the file spells them so."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 2, 80, 80
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdict = 6

    def repr_int(self, x: int, level: int) -> str:
        # repr() of a huge int takes quadratic time, and past 4300 digits raises (YAML reads hex without that limit)
        if x.bit_length() <= 128:
            return repr(x)
        return f"<an integer of about {int(math.log10(abs(x))) + 1} digits>"

    def repr_bool(self, x: bool, level: int) -> str:
        return "true" if x else "false"

    def repr_NoneType(self, x: None, level: int) -> str:
        return "null"

    def repr_float(self, x: float, level: int) -> str:
        if math.isnan(x):
            return ".nan"
        return repr(x) if math.isfinite(x) else "-.inf" if x < 0 else ".inf"


quote = _Quote().repr


def bad(source: str, path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{source}: {path}: got {quote(value)}; allowed: {allowed}")
