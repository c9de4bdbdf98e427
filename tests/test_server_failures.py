"""The server's own failures on the CPU (a real uvicorn server over the tiny engine): a song whose audio the server
cannot encode fails (counted as a failure, not a cancel, its held audio given back), and an error no route expected
is a 500 in the route's error body, listed in /openapi.json, its traceback logged."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import threading

import pytest

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")

from music3serve.errors import Music3Error
from music3serve.serving.access import Access
from music3serve.serving.api import create_app
from music3serve.serving.audio_io import PcmEncoder
from music3serve.serving.engine import Engine
from music3serve.serving.events import Done, SongRequest
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


GENERIC = re.compile(r"the server failed: an unexpected error \(reference ([0-9a-f]{8}) in the server's log\)")


def referenced(caplog, logger: str, message: str, needle: str) -> bool:
    """Whether `message` holds a reference that `logger` logged with the traceback of an error holding `needle`."""
    reference = GENERIC.search(message)
    return reference is not None and any(
        r.name == logger and getattr(r, "reference", None) == reference[1] and needle in str(r.exc_info[1])
        for r in caplog.records if r.exc_info)


def test_a_whole_song_whose_encoder_fails_is_a_500_counted_as_a_failure_and_its_audio_given_back(
        client, engine, monkeypatch, caplog):
    """The failure used to leave the two slices already encoded counted in the unread-audio budget for good
    (132,300 bytes), record the song as cancelled and count it in music3_cancels_total, and answer plain text."""
    break_the_encoder_at_its_third_feed(monkeypatch)
    failures, cancels = counts(engine)
    with caplog.at_level(logging.ERROR):
        response = client.post("/v1/songs", json={**LONG_SONG, "stream": False, "id": "codec-whole"})
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    status = client.get("/v1/songs/codec-whole").json()
    assert response.json() == {"error": f"song codec-whole failed: {status['error']}"}
    assert status["state"] == "failed" and GENERIC.fullmatch(status["error"])  # not the codec's own text
    assert counts(engine) == (failures + 1, cancels)
    assert engine.held.read_audio_held == 0
    assert referenced(caplog, "music3serve.serving.song_service", status["error"], "the codec broke")
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
    assert status["state"] == "failed" and GENERIC.fullmatch(status["error"])
    assert counts(engine) == (failures + 1, cancels)
    assert referenced(caplog, "music3serve.serving.song_service", status["error"], "the codec broke")
    poll_until(lambda: engine_idle(engine, "codec-stream"))


def broken(*args, **kwargs):
    raise RuntimeError("an unexpected bug in /opt/app/x.py for song 0/abc")


REFERENCE = "0123abcd"  # secrets.token_hex's, in these tests
MESSAGE = f"the server failed: an unexpected error (reference {REFERENCE} in the server's log)"
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
    """Starlette answered these with a plain-text 500 that no client of the route parses; its text (paths, a key's
    index in a song's engine id) is told only to the log, under the reference the client gets."""
    owner = engine if part[0] == "engine" else app.state.songs.songs
    monkeypatch.setattr(owner, part[1], broken)
    monkeypatch.setattr("music3serve.errors.secrets.token_hex", lambda nbytes: REFERENCE)
    with caplog.at_level(logging.ERROR):
        response = client.request(method, path, json=body)
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    assert response.json() == error
    documented = client.get("/openapi.json").json()["paths"][route][method.lower()]["responses"]["500"]
    jsonschema.validate(response.json(), documented["content"]["application/json"]["schema"])
    assert traced(caplog, "uvicorn.error", "an unexpected bug")
    assert referenced(caplog, "music3serve.serving.api", MESSAGE, "an unexpected bug")


def test_an_unexpected_error_of_our_own_keeps_its_text_and_an_allowed_origin_can_read_it(
        engine, serve_http, monkeypatch):
    """The 500 is sent from outside the CORS middleware: it had no CORS headers, so the page could not read it."""
    app = create_app(engine, access=Access(allowed_origins=("https://app.example",)))

    def refused(*args, **kwargs):
        raise Music3Error("our own words")

    monkeypatch.setattr(app.state.songs.songs, "lookup", refused)
    with serve_http(app) as url, httpx.Client(base_url=url, timeout=30) as browser:
        allowed = browser.get("/v1/songs/any", headers={"Origin": "https://app.example"})
        other = browser.get("/v1/songs/any", headers={"Origin": "https://other.example"})
    assert allowed.status_code == other.status_code == 500
    assert allowed.json() == other.json() == {"error": "the server failed: our own words"}
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert "X-Song-Id" in allowed.headers["access-control-expose-headers"]
    assert "access-control-allow-origin" not in other.headers


def song_seconds(engine: Engine) -> float:
    return engine.metrics.registry.get_sample_value("music3_song_seconds_count")


@pytest.mark.parametrize("stream", [False, True])
def test_a_song_whose_last_piece_cannot_be_encoded_counts_as_failed_not_done(client, engine, monkeypatch, stream):
    """The engine had ended the song as done: Engine.fail did nothing, so the failed song counted in
    music3_song_seconds and not in music3_failures_total."""
    real = PcmEncoder.feed

    def feed(self, pcm, last):
        if last:
            raise RuntimeError("the codec broke at the end")
        return real(self, pcm, last)

    monkeypatch.setattr(PcmEncoder, "feed", feed)
    (failures, cancels), done = counts(engine), song_seconds(engine)
    song = {**SONG, "duration": 2, "stream": stream, "id": f"codec-last-{stream}"}
    if stream:
        with client.stream("POST", "/v1/songs", json=song) as response, pytest.raises(httpx.RemoteProtocolError):
            response.read()
    else:
        assert client.post("/v1/songs", json=song).status_code == 500
    assert client.get(f"/v1/songs/{song['id']}").json()["state"] == "failed"
    poll_until(lambda: engine_idle(engine, song["id"]))
    assert (counts(engine), song_seconds(engine)) == ((failures + 1, cancels), done)


def test_a_song_deleted_before_its_encoder_fails_is_cancelled(client, url, engine, monkeypatch):
    """The encoder's error used to win: a 500 and `failed` for a song the client had deleted (counted a cancel)."""
    entered, go = threading.Event(), threading.Event()

    def feed(self, pcm, last):
        entered.set()
        go.wait(30)
        raise RuntimeError("the codec broke")

    monkeypatch.setattr(PcmEncoder, "feed", feed)
    failures, cancels = counts(engine)
    answer = {}
    post = threading.Thread(target=lambda: answer.setdefault("response", client.post(
        "/v1/songs", json={**LONG_SONG, "stream": False, "id": "deleted-codec"})))
    post.start()
    try:
        assert entered.wait(60)
        with httpx.Client(base_url=url, timeout=30) as other:
            assert other.delete("/v1/songs/deleted-codec").status_code == 204
    finally:
        go.set()
        post.join(60)
    assert answer["response"].status_code == 409
    assert client.get("/v1/songs/deleted-codec").json()["state"] == "cancelled"
    assert counts(engine) == (failures, cancels + 1)
    poll_until(lambda: engine_idle(engine, "deleted-codec"))


def test_a_song_the_talker_has_finished_is_not_queued(engine):
    """Between the talker dropping a finished song and its SongFinished reaching the caller's record, the song read
    as queued again (set here: a song read to its Done, its record's SongFinished taken back)."""
    async def scenario() -> bool:
        events = engine.submit(SongRequest(id="finished-not-queued", duration_s=2, steps=1, **{
            k: SONG[k] for k in ("caption", "lyrics", "seed")}))
        try:
            async for event in events:
                if isinstance(event, Done):
                    break
            engine.held.client(engine.held.key_of("finished-not-queued")).finished = None
            return engine.progress("finished-not-queued").queued
        finally:
            await events.aclose()

    assert asyncio.run(asyncio.wait_for(scenario(), 120)) is False
