"""The server's own failures on the CPU (a real uvicorn server over the tiny engine): a song whose audio the server
cannot encode fails (counted as a failure, not a cancel, its held audio given back), and an error no route expected
is a 500 in the route's error body, listed in /openapi.json, its traceback logged."""

from __future__ import annotations

import itertools
import logging

import pytest

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")

from music3serve.serving.api import create_app
from music3serve.serving.audio_io import PcmEncoder
from music3serve.serving.engine import Engine
from polling import poll_until  # tests/ is on the import path (no package)

SONG = {"caption": "synth pop, 120 bpm", "lyrics": "[verse]\nla la", "seed": 0, "steps": 2}
SPEECH = {"model": "MiniMax-Music3", "input": "[verse]\nla", "instructions": "pop", "max_new_tokens": 1, "steps": 1}
MUSIC = {"model": "MiniMax-Music3", "prompt": "pop", "lyrics": "[verse]\nla", "max_new_tokens": 1, "steps": 1}
# A song still running in the engine when its first window's third slice is encoded (60 s: 15 windows).
LONG_SONG = {**SONG, "duration": 60}


@pytest.fixture(scope="module")
def app(engine: Engine):
    return create_app(engine)


@pytest.fixture(scope="module")
def url(app, serve_http):
    with serve_http(app) as base_url:
        yield base_url


@pytest.fixture
def client(url: str):
    with httpx.Client(base_url=url, timeout=httpx.Timeout(60.0, connect=5.0)) as client:
        yield client


def counts(engine: Engine) -> tuple[float, float]:
    """(music3_failures_total, music3_cancels_total)."""
    sample = engine.metrics.registry.get_sample_value
    return sample("music3_failures_total"), sample("music3_cancels_total")


def break_the_encoder_at_its_third_feed(monkeypatch) -> None:
    """The WAV encoder raises on its third call (the song's first window is fed in slices: two went out)."""
    real, calls = PcmEncoder.feed, itertools.count()

    def feed(self, pcm, last):
        if next(calls) == 2:
            raise RuntimeError("the codec broke")
        return real(self, pcm, last)

    monkeypatch.setattr(PcmEncoder, "feed", feed)


def engine_idle(engine: Engine, song: str) -> bool:
    return engine.held.key_of(song) is None and not engine.talker.busy


def traced(caplog, logger: str, needle: str) -> bool:
    """Whether `logger` logged an error with the traceback of an exception whose text holds `needle`."""
    return any(r.name == logger and r.levelno >= logging.ERROR and r.exc_info and needle in str(r.exc_info[1])
               for r in caplog.records)


def test_a_whole_song_whose_encoder_fails_is_a_500_counted_as_a_failure_and_its_audio_given_back(
        client, engine, monkeypatch, caplog):
    """The failure used to leave the two slices already encoded counted in the unread-audio budget for good
    (132,300 bytes), record the song as cancelled and count it in music3_cancels_total, and answer plain text."""
    break_the_encoder_at_its_third_feed(monkeypatch)
    failures, cancels = counts(engine)
    with caplog.at_level(logging.ERROR):
        response = client.post("/v1/songs", json={**LONG_SONG, "stream": False, "id": "codec-whole"})
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    assert response.json() == {"error": "song codec-whole failed: the server failed: the codec broke"}
    status = client.get("/v1/songs/codec-whole").json()
    assert (status["state"], status["error"]) == ("failed", "the server failed: the codec broke")
    assert counts(engine) == (failures + 1, cancels)
    assert engine.held.read_audio_held == 0
    assert traced(caplog, "music3serve.serving.song_service", "the codec broke")
    poll_until(lambda: engine_idle(engine, "codec-whole"))  # its talker rows freed


def test_a_streamed_song_whose_encoder_fails_is_cut_as_a_failed_song(client, engine, monkeypatch, caplog):
    """The stream ends without its last chunk (as any failed song's), the song is failed and counted so, not
    cancelled."""
    break_the_encoder_at_its_third_feed(monkeypatch)
    failures, cancels = counts(engine)
    with caplog.at_level(logging.ERROR), client.stream("POST", "/v1/songs",
                                                       json={**LONG_SONG, "id": "codec-stream"}) as response:
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            response.read()
    status = client.get("/v1/songs/codec-stream").json()
    assert (status["state"], status["error"]) == ("failed", "the server failed: the codec broke")
    assert counts(engine) == (failures + 1, cancels)
    assert traced(caplog, "music3serve.serving.song_service", "the codec broke")
    poll_until(lambda: engine_idle(engine, "codec-stream"))


def broken(*args, **kwargs):
    raise RuntimeError("an unexpected bug")


MESSAGE = "the server failed: an unexpected bug"
PLAIN = {"error": MESSAGE}
OPENAI = {"error": {"message": MESSAGE, "type": "server_error", "param": None, "code": None}}
MINIMAX = {"data": None, "base_resp": {"status_code": 1000, "status_msg": MESSAGE}}
# (method, path, the path in the schema, JSON body, what to break: an attribute of the engine or of the song
# registry, the error body wanted)
ROUTES = [
    ("POST", "/v1/songs", "/v1/songs", SONG, ("engine", "submit"), PLAIN),
    ("POST", "/v1/audio/speech", "/v1/audio/speech", SPEECH, ("engine", "submit"), OPENAI),
    ("POST", "/v1/music_generation", "/v1/music_generation", MUSIC, ("engine", "submit"), MINIMAX),
    ("GET", "/v1/songs/any", "/v1/songs/{song_id}", None, ("songs", "lookup"), PLAIN),
    ("DELETE", "/v1/songs/any", "/v1/songs/{song_id}", None, ("songs", "cancel"), PLAIN),
    ("GET", "/health", "/health", None, ("engine", "unavailable"), PLAIN),
]


@pytest.mark.parametrize(("method", "path", "route", "body", "part", "error"), ROUTES,
                         ids=[f"{r[0]} {r[1]}" for r in ROUTES])
def test_an_unexpected_error_is_a_json_500_in_the_routes_error_body_and_its_traceback_is_logged(
        client, app, engine, monkeypatch, caplog, method, path, route, body, part, error):
    """Starlette answered these with a plain-text 500 that no client of the route parses."""
    owner = engine if part[0] == "engine" else app.state.songs.songs
    monkeypatch.setattr(owner, part[1], broken)
    with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
        response = client.request(method, path, json=body)
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    assert response.json() == error
    documented = client.get("/openapi.json").json()["paths"][route][method.lower()]["responses"]["500"]
    jsonschema.validate(response.json(), documented["content"]["application/json"]["schema"])
    assert traced(caplog, "uvicorn.error", "an unexpected bug")
