"""Declarative description of where each parameter of our modules lives in a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor (optionally a row range of it); a parameter concatenates its sources on dim 0."""

    key: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class WeightNormSource:
    """A weight-normed conv stored as magnitude g and direction v, folded into one weight at load time."""

    prefix: str
    shape: tuple[int, ...]

    def candidates(self) -> tuple[tuple[str, str], ...]:
        """(g, v) key pairs, for the classic and the parametrization naming of weight norm."""
        p = self.prefix
        return (
            (f"{p}.weight_g", f"{p}.weight_v"),
            (f"{p}.parametrizations.weight.original0", f"{p}.parametrizations.weight.original1"),
        )


ParamSource = list[Source] | WeightNormSource


def require(config: dict[str, Any], key: str) -> Any:
    """A config value that must be present."""
    if config.get(key) is None:
        raise CheckpointError(f"config.json has no '{key}'")
    return config[key]
