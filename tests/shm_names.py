"""What a shared-memory connector left in /dev/shm, as the tests look for it (the connector itself only removes its
segments: serving/shm_segments.py)."""

from __future__ import annotations

from music3serve.serving import shm_segments


def segments(connector, pid: int | None = None) -> list[str]:
    """Names of the connector's segments in /dev/shm now: all of them, or those process `pid` made (each is named
    <the connector's prefix><its creator's pid>_<random>)."""
    return shm_segments.list_segments(connector.prefix if pid is None else f"{connector.prefix}{pid}_")
