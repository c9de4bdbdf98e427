"""MUSIC3SERVE_PDL: the three modes, a clear error for anything else, and never PDL off CUDA."""

from __future__ import annotations

import pytest
import torch

from music3serve.kernels.pdl import inductor_pdl, pdl_mode, uses_pdl


@pytest.mark.parametrize(("value", "mode", "inductor"), [(None, "all", True), ("ours", "ours", False),
                                                          (" OFF ", "off", False), ("all", "all", True)])
def test_the_modes(monkeypatch, value, mode, inductor):
    if value is None:
        monkeypatch.delenv("MUSIC3SERVE_PDL", raising=False)
    else:
        monkeypatch.setenv("MUSIC3SERVE_PDL", value)
    assert pdl_mode() == mode
    assert inductor_pdl() is inductor
    assert not uses_pdl(torch.device("cpu"))


def test_an_unknown_mode_is_an_error_naming_the_choices(monkeypatch):
    monkeypatch.setenv("MUSIC3SERVE_PDL", "yes")
    with pytest.raises(ValueError, match="MUSIC3SERVE_PDL must be one of all, ours, off, got 'yes'"):
        pdl_mode()
