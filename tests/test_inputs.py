"""Request validation: duration, seed, steps, the frame budget, and Pipeline.generate refusing bad text early."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from music3serve import contract
from music3serve.errors import InputError
from music3serve.contract import frame_budget
from music3serve.pipeline import Pipeline
from music3serve.prompt import check_seed, check_steps, duration_for_frames, frames_for_duration
from music3serve.tokenizer import load_tokenizer


@pytest.mark.parametrize(
    "duration",
    [0, 0.0, -1.0, -0.04, math.nan, math.inf, -math.inf, 360.01, 361, 1e9, True, False, "30", None, [30.0]],
    ids=repr,
)
def test_bad_duration_is_an_input_error_naming_duration(duration):
    """Each is refused by the type or range check, which names the allowed range (0 is not "shorter than a frame")."""
    with pytest.raises(InputError, match="^duration must be"):
        frames_for_duration(duration)


def test_duration_shorter_than_one_frame():
    with pytest.raises(InputError, match=r"duration 0\.01 s is shorter than one frame"):
        frames_for_duration(0.01)
    with pytest.raises(InputError, match="shorter than one frame"):
        frames_for_duration(1 / contract.FRAME_RATE / 2)
    with pytest.raises(InputError, match=r"duration 0\.0399999999999999 s is shorter"):  # not rounded to one frame
        frames_for_duration(0.0399999999999999)


@pytest.mark.parametrize(
    ("duration", "frames"),
    [(360, 9000), (360.0, 9000), (359.99, 8999), (0.04, 1), (2.0, 50), (2, 50), (30.0, 750), (0.1, 2)],
)
def test_duration_to_frames(duration, frames):
    assert frames_for_duration(duration) == frames


def test_frame_budget_caps():
    assert contract.MAX_FRAMES == 9000 and contract.MAX_CONTEXT == 10240
    assert frame_budget(50, 100) == 50  # the request when it fits
    assert frame_budget(9001, 0) == 9000  # the 9000-frame cap
    assert frame_budget(20_000, 1_240) == 9000  # both caps meet exactly here
    assert frame_budget(20_000, 1_241) == 8999  # now the context is the tighter one
    assert frame_budget(9000, 5000) == 5240  # 10240 context minus a 5000-token prompt
    assert frame_budget(9000, contract.MAX_PROMPT_TOKENS) == contract.MAX_CONTEXT - contract.MAX_PROMPT_TOKENS
    assert frame_budget(100, 5000) == 100


@pytest.mark.parametrize("seed", [-1, 2**64, 2**65, 1.0, 0.5, True, False, "1", None])
def test_bad_seed(seed):
    with pytest.raises(InputError, match="seed"):
        check_seed(seed)


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1, 2**63, 2**64 - 1])
def test_good_seed(seed):
    assert check_seed(seed) == seed


@pytest.mark.parametrize("steps", [0, -1, 201, 1001, 2.0, True, "30", None])
def test_bad_steps(steps):
    with pytest.raises(InputError, match="steps"):
        check_steps(steps)


@pytest.mark.parametrize("steps", [1, 30, 200])
def test_good_steps(steps):
    assert check_steps(steps) == steps


class ModelWork(Exception):
    """Raised by the stand-ins of Pipeline.talk / Pipeline.render: the request got past validation."""


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return load_tokenizer(tiny_dir / "tokenizer")


@pytest.fixture()
def text_only_pipeline(tokenizer, monkeypatch: pytest.MonkeyPatch) -> Pipeline:
    """A Pipeline with only a tokenizer: any touch of a model would fail, and talk/render raise ModelWork."""

    def model_work(*args, **kwargs):
        raise ModelWork

    monkeypatch.setattr(Pipeline, "talk", model_work)
    monkeypatch.setattr(Pipeline, "render", model_work)
    return Pipeline(SimpleNamespace(tokenizer=tokenizer))


def test_valid_request_reaches_model_work(text_only_pipeline: Pipeline):
    # The control for the tests below: a good request does get to talk().
    with pytest.raises(ModelWork):
        text_only_pipeline.generate("synth pop", "[verse]\nla la", 2.0, 0, steps=2)


@pytest.mark.parametrize(
    ("caption", "lyrics", "field"),
    [
        ("", "[verse]\nla", "caption"),
        ("   \n\t", "[verse]\nla", "caption"),
        (None, "[verse]\nla", "caption"),
        (3, "[verse]\nla", "caption"),
        ("synth pop", None, "lyrics"),
        ("synth pop", b"[verse] la", "lyrics"),
        ("synth pop", 5, "lyrics"),
        ("synth pop", ["la"], "lyrics"),
        ("synth pop", "", "lyrics"),
        ("\u200b", "[verse]\nla", "caption"),  # a zero-width space: nothing visible
        ("synth pop", "\x00 \ufeff\u2060", "lyrics"),  # NUL, a byte-order mark, a word joiner
    ],
)
def test_generate_rejects_bad_text_before_model_work(text_only_pipeline: Pipeline, caption, lyrics, field):
    with pytest.raises(InputError, match=field):
        text_only_pipeline.generate(caption, lyrics, 2.0, 0, steps=2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"duration": 0.0}, "duration"), ({"duration": math.nan}, "duration"), ({"seed": -1}, "seed"),
     ({"steps": 0}, "steps"), ({"steps": 1001}, "steps")],
)
def test_generate_rejects_bad_numbers_before_model_work(text_only_pipeline: Pipeline, kwargs, field):
    request = {"caption": "synth pop", "lyrics": "[verse]\nla", "duration": 2.0, "seed": 0, "steps": 2} | kwargs
    with pytest.raises(InputError, match=field):
        text_only_pipeline.generate(**request)


def test_generate_rejects_an_overlong_prompt_before_model_work(text_only_pipeline: Pipeline):
    with pytest.raises(InputError, match="limit is 5000 tokens"):
        text_only_pipeline.generate("synth pop", "la " * 6000, 2.0, 0, steps=2)


def test_every_frame_count_has_a_duration_that_asks_for_exactly_it():
    """The frame caps of /v1/audio/speech (max_new_tokens) reach the engine as durations."""
    for frames in range(1, contract.MAX_FRAMES + 1):
        duration = duration_for_frames(frames)
        assert frames_for_duration(duration) == frames and duration <= contract.MAX_DURATION_S
