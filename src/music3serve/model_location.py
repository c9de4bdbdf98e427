"""Where the checkpoint is: --model, MUSIC3_MODEL, the Hugging Face cache, or the tiny random one (no torch)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .errors import Music3Error

log = logging.getLogger("music3serve")

REPO_ID = "MiniMaxAI/MiniMax-Music3"
GET_MODEL = (
    "no MiniMax-Music3 checkpoint found. Download it (57 GB) with\n"
    f"  hf download {REPO_ID}\n"
    "(huggingface-cli download on huggingface_hub before 1.0)\n"
    "then run again, or pass --model DIR, or set MUSIC3_MODEL=DIR, or try the pipeline on random weights with --tiny"
)


def xdg_cache() -> Path:
    """The user's cache folder: $XDG_CACHE_HOME, else ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def cache_root() -> Path:
    return xdg_cache() / "music3serve"


def tiny_checkpoint() -> Path:
    """The tiny random checkpoint in the cache folder, written on first use."""
    target = cache_root() / "tiny-v1"
    if not (target / "modular_model_index.json").is_file():
        from .tiny import write_tiny

        log.info("writing the tiny checkpoint", extra={"path": str(target)})
        write_tiny(target, replace=False)
    return target


def hf_cache_snapshot() -> Path | None:
    """The newest snapshot of the checkpoint in the local Hugging Face cache, if any."""
    # Where huggingface_hub puts it: HF_HUB_CACHE, its old name HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub,
    # where HF_HOME defaults to $XDG_CACHE_HOME/huggingface (then ~/.cache/huggingface).
    home = os.environ.get("HF_HOME") or xdg_cache() / "huggingface"
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or Path(home) / "hub"
    hub = Path(os.path.expandvars(os.path.expanduser(str(hub))))
    snapshots = hub / f"models--{REPO_ID.replace('/', '--')}" / "snapshots"
    found = [p for p in snapshots.glob("*") if (p / "modular_model_index.json").is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_model(model: str | None, tiny: bool) -> Path:
    if tiny:
        return tiny_checkpoint()
    if model:
        return Path(model)
    if os.environ.get("MUSIC3_MODEL"):
        return Path(os.environ["MUSIC3_MODEL"])
    snapshot = hf_cache_snapshot()
    if snapshot is None:
        raise Music3Error(GET_MODEL)
    return snapshot
