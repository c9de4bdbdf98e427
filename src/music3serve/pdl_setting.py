"""The MUSIC3SERVE_PDL setting (which kernels launch with programmatic dependent launch, kernels/pdl.py), read
without importing torch so that the command line can refuse a bad value at once."""

from __future__ import annotations

import os

from .errors import Music3Error

PDL_MODES = ("all", "ours", "off")


def pdl_mode() -> str:
    mode = os.environ.get("MUSIC3SERVE_PDL", "all").strip().lower()
    if mode not in PDL_MODES:
        raise Music3Error(f"MUSIC3SERVE_PDL must be one of {', '.join(PDL_MODES)}, got {mode!r}")
    return mode
