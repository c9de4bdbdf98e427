"""The keys the engine's stages know songs by, as the tests read them: the caller's id, "#" and a submission number
(HeldSongs.new_key)."""

from __future__ import annotations


def caller_id(key: str) -> str:
    """The caller's id of a song key."""
    return key.rpartition("#")[0]
