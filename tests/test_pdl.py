"""MUSIC3SERVE_PDL: the three modes, a clear error for anything else, and never PDL off CUDA."""

from __future__ import annotations

import pytest
import torch

from music3serve.errors import Music3Error
from music3serve.kernels.pdl import inductor_pdl, launch_options, pdl_mode, uses_pdl


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
    with pytest.raises(Music3Error, match="MUSIC3SERVE_PDL must be one of all, ours, off, got 'yes'"):
        pdl_mode()


def test_the_launch_keyword_is_only_passed_with_pdl():
    """Triton before 3.4 rejects `launch_pdl` even when False: without PDL the kernels get no keyword at all."""
    assert launch_options(False) == {}
    assert launch_options(True) == {"launch_pdl": True}


def test_the_engine_refuses_a_bad_mode_at_startup(monkeypatch, tiny_dir):
    from music3serve.checkpoint import load_models
    from music3serve.talker.config import TalkerConfig
    from music3serve.talker.engine import Talker

    models = load_models(tiny_dir)
    monkeypatch.setenv("MUSIC3SERVE_PDL", "on")
    with pytest.raises(Music3Error, match="MUSIC3SERVE_PDL"):
        Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig())
    monkeypatch.setenv("MUSIC3SERVE_PDL", "off")
    Talker(models.language_model, models.depth_decoder, models.condition_encoder, TalkerConfig())
