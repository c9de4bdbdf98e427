"""Bad input at every entrance gets a clear error, never a hang, a crash, a 500 or lost work for other songs.

Complements tests/test_api.py, tests/test_engine.py, tests/test_inputs.py and tests/test_cli.py with the cases they
leave out: JSON edge values (NaN, huge integers, invalid UTF-8, lone surrogates), text too long to clean cheaply,
disconnects beside other songs, ids cancelled before they exist, a closed engine, songs beyond the talker's rows,
and command-line values refused before the model loads. Songs are short (0.5-2 s, 1 Euler step) on the tiny
checkpoint; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")  # server extras
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient

from music3serve import cli
from music3serve.acoustic.windows import song_samples
from music3serve.checkpoint import load_models
from music3serve.errors import EngineBusy, InputError, Music3Error
from music3serve.prompt import check_seed, frames_for_duration
from music3serve.prompt import MAX_CAPTION_CHARS, MAX_LYRICS_CHARS, clean_caption, normalize_lyrics
from music3serve.serving import http_guard
from music3serve.serving.api import create_app
from music3serve.serving.deploy_config import load_deploy_config, parse_deploy_config
from music3serve.serving.engine import Engine
from music3serve.serving.engine_limits import MAX_SONGS
from music3serve.serving.events import Accepted, AudioChunk, Done, SongRequest
from music3serve.serving.body_limits import DRAIN_BYTES, MAX_BODY_BYTES, BoundedBody
from music3serve.serving.request_body import SongBody
from polling import poll_until  # tests/ is on the import path (no package)
from song_keys import caller_id


def callers(keys) -> set[str]:
    """The callers' ids of the song keys a stage holds."""
    return {caller_id(key) for key in keys}

SONG = {"caption": "synth pop", "lyrics": "[verse]\nla la", "seed": 0, "steps": 1, "duration": 0.5}
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
JSON = {"content-type": "application/json"}


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def requests_total(engine: Engine) -> float:
    return engine.metrics.registry.get_sample_value("music3_requests_total")


def idle(engine: Engine, song: str) -> bool:
    return engine.held.key_of(song) is None and song not in callers(engine.talker.songs) and not engine.talker.busy


async def events_of(engine: Engine, request: SongRequest) -> list:
    return [event async for event in engine.submit(request)]


# Fixtures.
@pytest.fixture(scope="module")
def models(tiny_dir: Path):
    return load_models(tiny_dir, "cpu")


@pytest.fixture(scope="module")
def engine(models):
    engine = Engine(models, load_deploy_config())
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def closed_engine(models):
    engine = Engine(models, load_deploy_config())
    engine.close()
    return engine


# --- HTTP: request bodies ---------------------------------------------------------------------------------
def raw(**fields: object) -> str:
    """SONG with changes, as JSON text; a str value starting with `=` goes in verbatim (NaN, escapes, huge ints)."""
    parts = [f'"{k}": {v[1:] if isinstance(v, str) and v.startswith("=") else json.dumps(v)}'
             for k, v in {**SONG, "stream": False, **fields}.items()]
    return "{" + ", ".join(parts) + "}"


BAD_BODIES = {
    "duration NaN": (raw(duration="=NaN"), "duration: Input should be a finite number"),
    "duration Infinity": (raw(duration="=Infinity"), "duration: Input should be a finite number"),
    "duration -Infinity": (raw(duration="=-Infinity"), "duration: Input should be a finite number"),
    "duration 1e308": (raw(duration=1e308), "duration: Input should be less than or equal to 360"),
    # an integer past a float's range: pydantic says only "Input should be a valid number"
    "duration of 311 digits": (raw(duration="=1" + "0" * 310),
                               "duration: a number of 311 digits is out of range (greater than 0, at most 360)"),
    "duration true": (raw(duration=True), "duration: Input should be a valid number"),
    "duration 1e-9": (raw(duration=1e-9), "duration 1e-09 s is shorter than one frame"),
    # Zero is refused by the body's schema (duration > 0), not left for the engine's own check to catch.
    "duration 0": (raw(duration=0), "duration: Input should be greater than 0"),
    "duration -0.0": (raw(duration="=-0.0"), "duration: Input should be greater than 0"),
    "seed 2**64": (raw(seed=2**64), "seed: Input should be less than 18446744073709551616"),
    "seed 1.5": (raw(seed=1.5), "seed: Input should be a valid integer"),
    "seed of 5000 digits": (raw(seed="=" + "9" * 5000),
                            "the body is not valid JSON: a number has more than 4300 digits"),
    "caption missing": ('{"lyrics": "la"}', "caption: Field required"),
    "caption 7": (raw(caption=7), "caption: Input should be a valid string"),
    "lyrics list": (raw(lyrics=["la"]), "lyrics: Input should be a valid string"),
    "lyrics empty": (raw(lyrics=""), "lyrics must be a non-empty string, got an empty string"),
    "sample_rate string": (raw(sample_rate="44100"), "sample_rate: must be an integer, one of 44100, 32000"),
    "format null": (raw(format=None), "format: Input should be 'wav', 'mp3', 'flac', 'opus', 'aac' or 'pcm'"),
    "caption lone surrogate": (raw(caption='="pop \\ud800 rock"'),
                               "caption is not valid Unicode: a lone surrogate '\\ud800' at character 4"),
    "lyrics lone surrogate": (raw(lyrics='="\\udfff"'),
                              "lyrics is not valid Unicode: a lone surrogate '\\udfff' at character 0"),
    "caption too long": (raw(caption="x" * (MAX_CAPTION_CHARS + 1)),
                         f"caption is 5001 characters long; the limit is {MAX_CAPTION_CHARS} characters"),
    "lyrics 0.6 MB": (raw(lyrics="la " * 200_000),
                      f"lyrics is 600000 characters long; the limit is {MAX_LYRICS_CHARS} characters"),
    # the parser's RecursionError spoke of "maximum recursion depth exceeded while decoding a JSON array"
    "arrays 5000 deep": (raw(caption="=" + "[" * 5000 + "]" * 5000),
                         "the body is not valid JSON: its arrays and objects are nested too deeply"),
    "truncated JSON": ('{"caption": "pop", "lyrics": "la",', "the body is not valid JSON: Expecting property name"),
    "a raw tab in a string": ('{"caption": "a\tb", "lyrics": "la"}',
                              "the body is not valid JSON: Invalid control character at character 14"),
    "empty body": ("", "the body is empty: send the song request as a JSON object"),
    "null body": ("null", "the body must be a JSON object"),
    "list body": ("[1, 2]", "the body must be a JSON object"),
    "id of 129 characters": (raw(id="a" * 129), "id: String should match pattern"),
    "empty id": (raw(id=""), "id: String should match pattern"),
    "id with a slash": (raw(id="a/b"), "id: String should match pattern"),  # GET /v1/songs/a/b could not reach it
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_bodies_are_400_naming_the_problem(client, engine, case):
    body, needle = BAD_BODIES[case]
    before = requests_total(engine)
    response = client.post("/v1/songs", content=body.encode(), headers=JSON)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]
    assert requests_total(engine) == before


@pytest.mark.parametrize("field, value", [("duration", 360), ("seed", 2**64 - 1), ("steps", 200)])
def test_the_body_schema_takes_its_inclusive_bounds(field: str, value: int) -> None:
    """docs/api.md's duration (0, 360], seed [0, 2^64) and steps 1 to 200 hold at their closed ends: the body's
    schema takes each (one past it is refused above and in test_api.py)."""
    body = SongBody.model_validate_json(json.dumps({"caption": "pop", "lyrics": "la", field: value}))
    assert getattr(body, field) == value


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "text/json"])
def test_a_body_not_sent_as_json_is_refused_naming_its_content_type(client, engine, content_type):
    """A JSON object sent without Content-Type: application/json (curl -d sends a form's type) is never parsed: the
    error names the header and the type sent (it said the body must be a JSON object, which it was)."""
    before = requests_total(engine)
    headers = {"content-type": content_type} if content_type else {}
    response = client.post("/v1/songs", content=raw().encode(), headers=headers)
    assert response.status_code == 400
    got = repr(content_type) if content_type else "missing"
    assert response.json()["error"] == ("send the body as JSON with Content-Type: application/json; this request's is "
                                        + got)
    assert requests_total(engine) == before


def test_a_body_is_utf8_json_naming_each_key_once(client, engine):
    """UTF-16 JSON (which the parser alone decodes), a repeated key (it would keep the last value silently) and a
    sample rate written as a float are refused."""
    before = requests_total(engine)
    for content, needle in [
        (raw().encode("utf-16"), "the body is not UTF-8 (byte 0xff at offset 0): send JSON as UTF-8 text"),
        (b'{"caption": "pop", "lyrics": "la", "seed": 1, "seed": 2}', "the body names 'seed' more than once"),
        (raw(sample_rate=32000.0).encode(), "sample_rate: must be an integer, one of 44100, 32000"),
    ]:
        response = client.post("/v1/songs", content=content, headers=JSON)
        assert response.status_code == 400 and needle in response.json()["error"], response.text
    assert requests_total(engine) == before


def test_a_byte_order_mark_is_ignored_and_the_body_is_still_checked(client, engine):
    """A UTF-8 BOM made the key checks give up (their decoder kept it), while the framework's parser ignored it: a
    repeated key kept its last value, and 20,000 unknown keys went to validation one by one."""
    bom = b"\xef\xbb\xbf"
    before = requests_total(engine)
    many = json.dumps({**json.loads(raw()), **{f"k{i}": i for i in range(20_000)}}).encode()
    for content, needle in [
        (bom + b'{"caption": "pop", "lyrics": "la", "seed": 1, "seed": 2}', "the body names 'seed' more than once"),
        (bom + many, "the body has 20000 unknown keys"),
    ]:
        response = client.post("/v1/songs", content=content, headers=JSON)
        assert response.status_code == 400 and needle in response.json()["error"], response.text[:300]
    assert requests_total(engine) == before
    response = client.post("/v1/songs", content=bom + raw(seed=3).encode(), headers=JSON)
    assert response.status_code == 200 and response.headers["x-seed"] == "3", response.text[:300]


@pytest.mark.parametrize("length, status, needle", [
    ("\u00b2".encode("latin-1"), 400, b"is not a byte count"),  # "²".isdigit(), and int() refuses it
    (b"9" * 5000, 413, b"the body is 99999999999999999999... (5000 digits) bytes"),  # int() refuses > 4300 digits
    (b"0" * 5000 + b"12", 200, b"reached the app"),  # 12, within the limit: the app reads the body
])
def test_content_lengths_int_would_refuse_are_answered(length, status, needle):
    """The check raised instead of answering (h11 refuses such headers first, but not every ASGI server does). The
    middleware alone, as such a server would call it."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"reached the app"})

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/songs", "headers": [(b"content-length", length)]}
    run(BoundedBody(app)(scope, None, send))
    assert sent[0]["status"] == status and needle in sent[1]["body"], sent


def test_an_unknown_or_repeated_key_is_named_briefly(client):
    """A key of half a megabyte came back whole in the error message."""
    key = "k" * 500_000
    for content, needle in [
        (raw(**{key: 1}).encode(), f"{key[:80]}: unknown key"),
        (f'{{"{key}": 1, "{key}": 2}}'.encode(), f"the body names '{key[:79]} more than once"),
    ]:
        response = client.post("/v1/songs", content=content, headers=JSON)
        assert response.status_code == 400 and needle in response.json()["error"], response.text[:200]
        assert len(response.content) < 300


def test_many_unknown_keys_get_one_short_error_at_once(client):
    """60,000 unknown keys came back as a 2.4 MB error, each request holding the server's loop for ~0.5 s."""
    body = json.loads(raw())
    body.update({f"k{i}": i for i in range(60_000)})
    response = client.post("/v1/songs", content=json.dumps(body).encode(), headers=JSON)
    assert response.status_code == 400 and len(response.content) < 400, response.text[:400]
    assert response.json()["error"].startswith("the body has 60000 unknown keys ('k0', 'k1', 'k2', 'k3', 'k4', ...);")
    few = {"caption": "pop", "lyrics": "la", **{f"k{i}": i for i in range(7)}}  # no more keys than fields: validated
    error = client.post("/v1/songs", content=json.dumps(few).encode(), headers=JSON).json()["error"]
    allowed = "the keys allowed: caption, lyrics, duration, seed, steps, format, sample_rate, stream, id"
    assert error.count("unknown key") == 5 and error.endswith(f"and 2 more; {allowed}"), error
    six = {"caption": "pop", "lyrics": "la", **{f"k{i}": i for i in range(6)}}  # one error past the five shown
    error = client.post("/v1/songs", content=json.dumps(six).encode(), headers=JSON).json()["error"]
    assert error.count("unknown key") == 5 and error.endswith(f"and 1 more; {allowed}"), error
    one_too_many = {"caption": "pop", "lyrics": "la", **{f"k{i}": i for i in range(8)}}  # 10 keys, 9 fields
    error = client.post("/v1/songs", content=json.dumps(one_too_many).encode(), headers=JSON).json()["error"]
    assert error.startswith("the body has 8 unknown keys"), error


def test_unknown_keys_and_values_not_objects_are_told_in_the_apis_words(client):
    """An unknown key's message names the keys allowed where it is (the fields refused with a reason left out); a
    value that must be an object says so, not pydantic's words."""
    speech = {"model": "MiniMax-Music3", "input": "la", "instructions": "pop", "voices": "x"}
    error = client.post("/v1/audio/speech", json=speech).json()["error"]["message"]
    assert error == ("voices: unknown key; the keys allowed: model, input, instructions, voice, seed, max_new_tokens, "
                     "response_format, sample_rate, stream, stream_format, speed, steps")
    music = {"model": "MiniMax-Music3", "prompt": "pop", "lyrics": "la"}
    error = client.post("/v1/music_generation", json={**music, "audio_setting": {"rate": 1}}).json()
    assert error["base_resp"]["status_msg"] == ("audio_setting.rate: unknown key; the keys allowed in audio_setting: "
                                                "sample_rate, bitrate, format")
    error = client.post("/v1/music_generation", json={**music, "audio_setting": "wav"}).json()
    assert error["base_resp"]["status_msg"] == "audio_setting: must be a JSON object"


def test_undecodable_body_and_wrong_content_type(client):
    response = client.post("/v1/songs", content=b'{"caption": "\xff\xfe", "lyrics": "la"}', headers=JSON)
    assert response.status_code == 400
    assert response.json()["error"] == "the body is not UTF-8 (byte 0xff at offset 13): send JSON as UTF-8 text"
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
        response = client.post("/v1/songs", content=raw().encode(), headers=headers)
        assert response.status_code == 400
        assert "Content-Type: application/json" in response.json()["error"]


def test_bodies_without_a_length_or_over_the_limit_are_refused_unread(client, engine):
    before = requests_total(engine)
    response = client.post("/v1/songs", content=b" " * (MAX_BODY_BYTES + 1) + raw().encode(), headers=JSON)
    assert response.status_code == 413 and "the limit is 1048576 bytes" in response.json()["error"]
    response = client.post("/v1/songs", content=iter([raw().encode()]), headers=JSON)  # chunked, no length
    assert response.status_code == 411 and "Content-Length" in response.json()["error"]
    assert requests_total(engine) == before


def test_a_chunked_body_beside_a_content_length_is_refused_and_its_connection_closed(base_url, client, engine):
    """A Transfer-Encoding overrides the Content-Length beside it, so the 10 bytes it declared bounded nothing: a body
    of any size was read whole (300 MB in 7 s) before its caption's length was judged. The 411 closes the connection
    (RFC 9112 6.1), so that no request is read out of bytes a proxy framed by the Content-Length: the GET after the
    body gets no answer."""
    host, port = base_url.removeprefix("http://").split(":")
    before = requests_total(engine)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        # One small segment, read at once: a close with bytes left unread would send a reset, not the answer.
        conn.sendall(b"POST /v1/songs HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
                     b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")  # a request after the body
        answer = b""
        while data := conn.recv(4096):  # until the server closes the connection
            answer += data
    assert answer.startswith(b"HTTP/1.1 411 ") and b"not in chunks (Transfer-Encoding)" in answer, answer
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # closed after the 411: what followed was never framed as a request
    assert requests_total(engine) == before
    assert client.get("/health").status_code == 200


def connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def song_post(*headers: bytes) -> bytes:
    """A song POST's request line and headers, with these added (the body, if any, is the caller's to send)."""
    return (b"POST /v1/songs HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + b"".join(header + b"\r\n" for header in headers) + b"\r\n")


def answer(conn: socket.socket, until_closed: bool) -> bytes:
    """What the server sends: until it closes the connection, or else until a JSON body has ended."""
    data = b""
    while until_closed or not data.endswith(b"}"):
        chunk = conn.recv(65536)  # a reset raises: the answer was lost
        if not chunk:
            break
        data += chunk
    return data


def test_a_chunked_body_sent_in_pieces_is_read_before_its_411(base_url):
    """test_bodies_without_a_length_or_over_the_limit_are_refused_unread failed 1 run in 3 on a loaded machine with
    httpx's "connection reset by peer"; reproduced (1 run in 40 unloaded), it was the 411 each time, not the 413
    before it. The 411 closes its connection and went out once the headers came, while httpx sends the chunked body
    after them: a close with body bytes unread, or with more still arriving, made the server's kernel reset the
    connection, and the answer was lost with it. Here the body comes in pieces, so the server had closed before the
    second one, which was refused (broken pipe); the body is now read and dropped before the answer."""
    with connect(base_url) as conn:
        conn.sendall(song_post(b"Transfer-Encoding: chunked"))
        for _ in range(8):
            time.sleep(0.05)
            conn.sendall(b"2000\r\n" + b" " * 0x2000 + b"\r\n")
        conn.sendall(b"0\r\n\r\n")
        got = answer(conn, until_closed=True)
    assert got.startswith(b"HTTP/1.1 411 ") and b"not in chunks (Transfer-Encoding)" in got, got
    assert b"connection: close" in got.lower(), got


def test_an_oversized_body_with_a_pause_in_it_is_read_before_its_413(engine, serve_http):
    """The 413 went out once the headers came, and uvicorn armed its keep-alive timer at it (5 s by default, 1 s
    here): a client pausing longer before or in its body found the connection closed, the rest of its body refused
    (broken pipe, or a reset where bytes were left unread). The body is now read and dropped first, within the read
    deadline (see below), and answered on a connection that stays open for the next request."""
    size = MAX_BODY_BYTES + 1000
    with serve_http(create_app(engine), timeout_keep_alive=1) as url, connect(url) as conn:
        conn.sendall(song_post(b"Content-Length: %d" % size))
        time.sleep(1.5)
        for _ in range(8):
            conn.sendall(b" " * (size // 8))
            time.sleep(0.05)
        # The body's last bytes, and a request after it: framed where the body ends, it is answered after the 413.
        conn.sendall(b" " * (size % 8) + b"GET /health HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        refused, _, after = answer(conn, until_closed=True).partition(b"}")
    assert refused.startswith(b"HTTP/1.1 413 ") and b"the limit is 1048576 bytes" in refused, refused
    assert b"connection: close" not in refused.lower() and after.startswith(b"HTTP/1.1 200 "), (refused, after)


@pytest.mark.parametrize("size", [DRAIN_BYTES, DRAIN_BYTES + 1])
def test_a_body_up_to_drain_bytes_is_dropped_and_a_larger_one_refused_at_once_with_a_close(base_url, size):
    """A body past DRAIN_BYTES is not read: its 413 comes before it is sent, and closes the connection."""
    with connect(base_url) as conn:
        conn.sendall(song_post(b"Content-Length: %d" % size))
        if size <= DRAIN_BYTES:
            conn.sendall(b" " * size)
        got = answer(conn, until_closed=size > DRAIN_BYTES)
    assert got.startswith(b"HTTP/1.1 413 ") and b"the body is %d bytes" % size in got, got
    assert (b"connection: close" in got.lower()) == (size > DRAIN_BYTES), got


@pytest.mark.parametrize("framing, status", [(b"Content-Length: %d" % (MAX_BODY_BYTES + 1), 413),
                                             (b"Transfer-Encoding: chunked", 411)], ids=["413", "411"])
def test_a_client_waiting_for_100_continue_is_refused_without_being_asked_for_its_body(base_url, framing, status):
    """Reading a body to drop it would send the 100 Continue the client waits for; it gets the refusal instead, and
    the connection closes (it may or may not send its body next: its next request could not be framed)."""
    with connect(base_url) as conn:
        conn.sendall(song_post(framing, b"Expect: 100-continue"))
        got = answer(conn, until_closed=True)
    assert got.startswith(b"HTTP/1.1 %d " % status) and b"100 Continue" not in got, got
    assert b"connection: close" in got.lower(), got


def test_a_refused_body_sent_too_slowly_loses_its_connection_at_the_read_deadline(engine, serve_http, monkeypatch):
    """Dropping a refused body is bounded in time by the server's read deadline (http_guard), as reading an
    accepted one is: the body never finished, the connection is closed unanswered."""
    monkeypatch.setattr(http_guard, "REQUEST_READ_S", 0.5)
    with serve_http(create_app(engine), http=http_guard.guarded_protocol(None)) as url, connect(url) as conn:
        conn.sendall(song_post(b"Content-Length: %d" % (MAX_BODY_BYTES + 1)) + b" " * 1000)
        start = time.monotonic()
        assert answer(conn, until_closed=True) == b""
        assert time.monotonic() - start < 5


def test_a_body_of_exactly_the_limit_with_an_id_of_128_characters_is_taken(client):
    """The limits are inclusive: MAX_BODY_BYTES of JSON (padded with spaces) is read, and an id of 128 characters
    names its song (a byte more is refused; a character more: see BAD_BODIES)."""
    body = raw(id="a" * 128).encode()
    response = client.post("/v1/songs", content=body + b" " * (MAX_BODY_BYTES - len(body)), headers=JSON)
    assert response.status_code == 200, response.text
    assert response.headers["x-song-id"] == "a" * 128
    response = client.post("/v1/songs", content=body + b" " * (MAX_BODY_BYTES + 1 - len(body)), headers=JSON)
    assert response.status_code == 413


def test_a_full_engine_answers_429_with_retry_after(client, engine):
    def busy_refusals() -> float:
        return engine.metrics.registry.get_sample_value("music3_refusals_total", {"reason": "busy"})

    before = busy_refusals()
    engine.max_songs = len(engine.held)
    try:
        response = client.post("/v1/songs", json=SONG)
        with pytest.raises(EngineBusy, match="its limit; try again when one ends"):
            run(events_of(engine, SongRequest("pop", "la", 0.5, 0, 1)))
    finally:
        engine.max_songs = MAX_SONGS
    assert response.status_code == 429 and response.headers["retry-after"] == "10"
    assert "its limit" in response.json()["error"]
    assert busy_refusals() == before + 2  # the POST's and the Python API's, each counted as busy
    assert client.post("/v1/songs", json={**SONG, "stream": False}).status_code == 200


def test_emoji_rtl_and_nul_are_ordinary_text(client):
    body = {**SONG, "stream": False, "caption": "dream pop 🎧 \u05e9\u05dc\u05d5\u05dd \u202eRTL\u202c \x00",
            "lyrics": "[verse]\n\u0645\u0631\u062d\u0628\u0627 \u200d👩‍🎤\x00 la"}
    response = client.post("/v1/songs", json=body)
    assert response.status_code == 200, response.text
    assert len(response.content) == 44 + 4 * song_samples(int(SONG["duration"] * 25))


# --- HTTP: cancelling and disconnecting -------------------------------------------------------------------
def test_cancelling_an_unknown_id_is_harmless_and_does_not_linger(client, engine):
    for _ in range(2):
        assert client.delete("/v1/songs/ghost-1").status_code == 204
    assert client.get("/v1/songs/ghost-1").status_code == 404
    # A song that takes the id afterwards is not hit by the earlier cancels.
    response = client.post("/v1/songs", json={**SONG, "stream": False, "id": "ghost-1"})
    assert response.status_code == 200, response.text
    assert client.get("/v1/songs/ghost-1").json()["state"] == "done"


def test_a_disconnecting_client_leaves_the_other_songs_whole(base_url, client, engine):
    outcome = {}

    def bystander():
        with httpx.Client(base_url=base_url, timeout=TIMEOUT) as other:
            outcome["response"] = other.post("/v1/songs", json={**SONG, "duration": 2, "stream": False, "id": "stays"})

    thread = threading.Thread(target=bystander)
    with client.stream("POST", "/v1/songs", json={**SONG, "duration": 60, "id": "leaves"}) as response:
        assert response.status_code == 200
        pieces = response.iter_raw()  # kept: a dropped iterator would close the connection there and then
        assert next(pieces)[:4] == b"RIFF"
        thread.start()
        poll_until(lambda: {"stays", "leaves"} <= callers(engine.talker.songs))  # both songs are in the talker now
    # Leaving the block closed the connection with the body unread.
    poll_until(lambda: client.get("/v1/songs/leaves").json()["state"] == "cancelled")
    thread.join(timeout=60)
    assert not thread.is_alive()
    poll_until(lambda: idle(engine, "leaves"))
    response = outcome["response"]
    assert response.status_code == 200, response.text
    assert len(response.content) == 44 + 4 * song_samples(50)
    status = client.get("/v1/songs/stays").json()
    assert (status["state"], status["frames"]) == ("done", 50)


def test_a_disconnecting_non_streaming_client_cancels_its_song(base_url, client, engine):
    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps({**SONG, "duration": 60, "stream": False, "id": "whole-gone"}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/songs HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        poll_until(lambda: client.get("/v1/songs/whole-gone").status_code == 200)
    poll_until(lambda: client.get("/v1/songs/whole-gone").json()["state"] == "cancelled")
    poll_until(lambda: idle(engine, "whole-gone"))


def test_a_closed_engine_answers_503(closed_engine):
    with TestClient(create_app(closed_engine)) as client:
        response = client.post("/v1/songs", json=SONG)
        health = client.get("/health")
    assert response.status_code == 503
    assert response.json()["error"] == "the engine cannot take songs: the engine is closed; it takes no more songs"
    assert health.status_code == 503 and health.json() == {"status": "unavailable", "reason": "the engine is closed"}
    closed_engine.close()  # a second close does nothing


def test_the_app_closes_an_engine_it_owns_when_the_server_stops(models):
    """`music3serve serve` hands the engine to the app: uvicorn re-raises SIGTERM after its shutdown, so the app's
    own shutdown is the last chance to stop the stages (and a split layout's worker)."""
    engine = Engine(models, load_deploy_config())
    with TestClient(create_app(engine)):
        pass
    assert engine.unavailable() is None  # not its engine: left running
    with TestClient(create_app(engine, close_engine=True)) as client:
        assert client.get("/health").json() == {"status": "ok"}
    assert engine.unavailable() == "the engine is closed"
    assert not any(thread.is_alive() for thread in engine._threads)


# --- Engine API -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "request_, needle",
    [
        ({"caption": "pop", "lyrics": "la"}, "submit takes a SongRequest, got dict"),
        (None, "submit takes a SongRequest, got NoneType"),
        (SongRequest("pop", "la", seed=10**5000), "seed must be an integer in [0, 2**64), got an integer of 16610 bits"),
        (SongRequest("pop", "la", duration_s=10**400), "duration must be in (0, 360] seconds, got an integer of"),
        (SongRequest("pop", "la", steps=10**5000), "steps must be an integer in [1, 200], got an integer of"),
        (SongRequest("pop \ud83c\udfa7", "la"), "caption is not valid Unicode: a lone surrogate '\\ud83c'"),
    ],
    ids=["dict", "None", "huge seed", "huge duration", "huge steps", "surrogate pair as two code units"],
)
def test_engine_refuses_bad_request_objects_with_input_error(engine, request_, needle):
    before = requests_total(engine)
    with pytest.raises(InputError) as error:
        run(events_of(engine, request_))
    assert needle in str(error.value)
    assert requests_total(engine) == before and not engine.talker.songs


def test_submit_after_close_raises_at_once(closed_engine):
    with pytest.raises(Music3Error, match="the engine is closed; it takes no more songs"):
        run(events_of(closed_engine, SongRequest("pop", "la", 0.5, 0, 1, id="late")), timeout=10)
    assert not closed_engine.held and requests_total(closed_engine) == 0


def test_songs_beyond_the_talker_rows_wait_and_all_finish(models):
    # One cond/uncond pair of rows: the second and third song are accepted at once and wait in the queue.
    deploy = parse_deploy_config({"stages": [{"stage_id": 0, "max_num_seqs": 2}, {"stage_id": 1, "max_num_seqs": 1}]},
                                 "one-pair test deploy")
    engine = Engine(models, deploy)
    try:
        async def three():
            log: list = []

            async def one(i: int) -> list:
                events = []
                async for event in engine.submit(SongRequest("pop", f"[verse]\nline {i}", 0.5, i, 1, id=f"q{i}")):
                    events.append(event)
                    log.append(event)
                return events

            return await asyncio.gather(*(one(i) for i in range(3))), log

        results, log = run(three())
    finally:
        engine.close()
    first_done = next(k for k, e in enumerate(log) if isinstance(e, Done))
    assert sum(isinstance(e, Accepted) for e in log[:first_done]) == 3  # queued, not refused
    for events in results:
        assert isinstance(events[0], Accepted) and isinstance(events[-1], Done), events
        assert events[-1].frames == 12 and any(isinstance(e, AudioChunk) for e in events)


# --- Prompt cleaning stays linear at the length limits ----------------------------------------------------
def test_pathological_text_at_the_limits_is_cleaned_fast():
    caption = "pop\n" + "\n" * (MAX_CAPTION_CHARS - 10) + "---"
    nested = "*" * (MAX_CAPTION_CHARS // 2 - 1) + "a" + "*" * (MAX_CAPTION_CHARS // 2 - 1)
    lyrics = "[verse] la\n" + "[" * (MAX_LYRICS_CHARS - 11)
    started = time.perf_counter()
    assert clean_caption(caption) == "pop\n"
    assert clean_caption(nested) == "a"
    # Each unclosed "[" used to be scanned to the end of the text: 1.5 s here.
    assert normalize_lyrics(lyrics) == "[start]\n[verse]\n" + "[" * (MAX_LYRICS_CHARS - 11)
    assert time.perf_counter() - started < 0.5


def test_huge_numbers_are_input_errors_not_overflow():
    with pytest.raises(InputError, match="an integer of 1329 bits"):
        frames_for_duration(10**400)
    with pytest.raises(InputError, match="an integer of 16610 bits"):
        check_seed(10**5000)


# --- CLI ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_cli_bad_port_is_a_usage_error(port, capsys, root_logger):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--tiny", "--port", port])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port" in err and port in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--duration", "nan"], "error: duration must be a finite number of seconds, got nan"),
        (["--duration", "400"], "error: duration must be in (0, 360] seconds, got 400.0"),
        (["--duration", "0.001"], "error: duration 0.001 s is shorter than one frame"),
        (["--seed", str(2**64)], "error: seed must be an integer in [0, 2**64)"),
        (["--steps", "0"], "error: steps must be an integer in [1, 200], got 0"),
        (["--caption", " "], "error: caption must be a non-empty string, got only whitespace"),
        (["--lyrics", "la " * 7000], "error: lyrics is 21000 characters long; the limit is 20000 characters"),
    ],
    ids=["nan", "400 s", "0.001 s", "seed 2**64", "steps 0", "blank caption", "long lyrics"],
)
def test_cli_bad_values_fail_before_the_model_loads(tmp_path, capsys, root_logger, flags, needle):
    # The model folder does not exist: the value must be refused before anyone looks for it.
    argv = ["generate", "--caption", "pop", "--lyrics", "la", "-o", str(tmp_path / "out.wav"),
            "--model", str(tmp_path / "absent"), *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and err.startswith(needle), err
    assert not (tmp_path / "out.wav").exists()


@pytest.mark.parametrize("name", ["song.wav", "songs"])  # a folder without a suffix was "must be NAME.wav ..."
def test_cli_output_that_is_a_folder_fails_before_the_model_loads(tmp_path, capsys, root_logger, name):
    (tmp_path / name).mkdir()
    argv = ["generate", "--caption", "pop", "--lyrics", "la", "-o", str(tmp_path / name),
            "--model", str(tmp_path / "absent")]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (f"error: cannot write {tmp_path / name}: it is a folder (give the song's file "
                                       "name, NAME.wav or NAME.flac)\n")


def test_cli_deploy_config_errors_quote_long_values_briefly(tmp_path, capsys, root_logger):
    config = tmp_path / "deploy.yaml"
    config.write_text("not a mapping " * 2000)
    assert cli.main(["serve", "--model", str(tmp_path), "--device", "cpu", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {config}: <top level>: got 'not a mapping") and len(err) < 600
    assert "allowed: a mapping" in err


def test_the_body_bounds_hold_when_the_app_is_mounted_under_a_prefix(closed_engine):
    """Behind a root path (uvicorn --root-path, or mounted in another app) a song POST without Content-Length is
    still 411 and an oversized one 413, before any of it is read."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    outer = Starlette(routes=[Mount("/api", app=create_app(closed_engine))])
    with TestClient(outer) as client:
        chunked = client.post("/api/v1/songs", content=iter([b"{}"]), headers={"content-type": "application/json"})
        big = client.post("/api/v1/songs", content=b" " * (MAX_BODY_BYTES + 1),
                          headers={"content-type": "application/json"})
    assert chunked.status_code == 411
    assert big.status_code == 413
