"""The HTTP API on the CPU: a real uvicorn server in a thread over an Engine on the tiny checkpoint.

Streams are compared sample for sample (int16, +-1 LSB) with the engine's own events, which match the offline
pipeline to 1.5e-4; cancellation by DELETE,
by a client that goes away and by a failing stage is checked against the engine's state and its metrics."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import re
import struct
import sys
import threading
import time
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")  # server extras: the GPU box has none of them
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from music3serve import cli, contract
from music3serve.errors import InputError
from music3serve.pipeline import Pipeline
from music3serve.serving.audio_io import resample, to_pcm16
from music3serve.serving.engine import Engine
from music3serve.serving.engine_limits import MAX_SONGS
from music3serve.serving.events import Accepted, AudioChunk, Done, SongRequest
from polling import hold, poll_until  # tests/ is on the import path (no package)
from song_keys import caller_id

SONG = {"caption": "synth pop, 120 bpm", "lyrics": "[verse]\nla la", "seed": 0, "steps": 2}
LONG = 10  # seconds: two windows, so streaming and 32 kHz resampling cross a window boundary
SHORT = 2
TIMEOUT = httpx.Timeout(60.0, connect=5.0)


@pytest.fixture(scope="module")
def songs(engine: Engine) -> dict[int, np.ndarray]:
    """The song per duration as the engine's own events carry it (float32, 44.1 kHz), checked against the
    offline pipeline. Those two differ by rounding (decode attention vs SDPA in the talker, amplified by the
    tiny random DiT; tests/test_engine.py measured 5.6e-5, about 2 LSB), so the API is held to the engine's
    events to +-1 LSB and to the offline pipeline to the engine tests' 1.5e-4."""

    async def collect(duration: float) -> np.ndarray:
        request = SongRequest(SONG["caption"], SONG["lyrics"], duration, SONG["seed"], SONG["steps"])
        pcm = [e.pcm async for e in engine.submit(request) if isinstance(e, AudioChunk)]
        return np.concatenate(pcm, axis=-1)

    pipe = Pipeline(engine.models)
    out = {}
    for duration in (SHORT, LONG):
        out[duration] = asyncio.run(asyncio.wait_for(collect(duration), 60))
        offline = pipe.generate(SONG["caption"], SONG["lyrics"], duration, SONG["seed"], steps=SONG["steps"]).waveform
        assert out[duration].shape == offline.shape
        # Measured at worst 7.4e-5 in tests/test_engine.py; its bound (float16 rounding, 2.4e-4, fails it).
        assert np.abs(np.clip(out[duration], -1, 1) - offline).max() < 1.5e-4
    return out


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    text = client.get("/metrics").text
    series = f"{name}_total{{{labels}}}" if labels else f"{name}_total"
    match = re.search(rf"^{re.escape(series)} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def samples(body: bytes) -> np.ndarray:
    assert len(body) % 4 == 0
    return np.frombuffer(body, dtype="<i2").reshape(-1, 2)


def assert_close_pcm(got: np.ndarray, want: np.ndarray) -> None:
    """int16 samples equal to +-1 LSB (float rounding before the conversion)."""
    assert got.shape == want.shape
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


def parse_wav(body: bytes, streaming: bool) -> tuple[int, np.ndarray]:
    riff, size, wave_, fmt, fmt_size, tag, channels, rate, byte_rate, block, bits, data, data_size = struct.unpack(
        "<4sI4s4sIHHIIHH4sI", body[:44]
    )
    assert (riff, wave_, fmt, data) == (b"RIFF", b"WAVE", b"fmt ", b"data")
    assert (fmt_size, tag, channels, bits, block, byte_rate) == (16, 1, 2, 16, 4, rate * 4)
    if streaming:
        assert size == data_size == 0xFFFFFFFF
    else:
        assert data_size == len(body) - 44 and size == len(body) - 8
    return rate, samples(body[44:])


def engine_idle(engine: Engine, song: str) -> bool:
    return engine.held.key_of(song) is None and not engine.talker.busy


# --- audio ------------------------------------------------------------------------------------------------
def test_streaming_wav_equals_the_song_and_arrives_before_it_ends(client, songs):
    with client.stream("POST", "/v1/songs", json={**SONG, "duration": LONG}) as response:
        assert response.status_code == 200, response.read()
        headers = response.headers
        assert headers["content-type"] == "audio/wav"
        assert headers["x-accel-buffering"] == "no"  # proxies pass the stream on as it comes
        assert (headers["x-seed"], headers["x-frame-budget"], headers["x-sample-rate"]) == ("0", "250", "44100")
        body, status_while_streaming = b"", None
        for piece in response.iter_bytes():
            body += piece
            if status_while_streaming is None and len(body) > 44 + 4 * contract.SAMPLE_RATE:
                status_while_streaming = client.get(f"/v1/songs/{headers['x-song-id']}").json()["state"]
    assert status_while_streaming == "running"  # the first window reached us before the last was rendered
    rate, pcm = parse_wav(body, streaming=True)
    assert rate == 44100
    assert_close_pcm(pcm, to_pcm16(songs[LONG]))
    assert (pcm != 0).any()
    status = client.get(f"/v1/songs/{headers['x-song-id']}").json()
    assert status["state"] == "done" and status["frames"] == 250 and status["samples_sent"] == len(pcm)


def test_streaming_32k_has_no_gaps_between_windows(client, songs):
    with client.stream("POST", "/v1/songs", json={**SONG, "duration": LONG, "sample_rate": 32000}) as response:
        assert response.status_code == 200 and response.headers["x-sample-rate"] == "32000"
        song, body = response.headers["x-song-id"], response.read()
    rate, pcm = parse_wav(body, streaming=True)
    assert rate == 32000
    assert_close_pcm(pcm, to_pcm16(resample(songs[LONG], 44100, 32000)))
    assert client.get(f"/v1/songs/{song}").json()["samples_sent"] == len(pcm)  # the resampler's tail counted too


def test_a_resampler_tail_flushed_at_done_is_sent():
    """A Done after a chunk not marked last (the engine marks its last chunk, which flushes the 32 kHz resampler
    then; the API does not rely on it): the tail the resampler held back is sent at Done (and so counted in
    samples_sent, which counts what the connection takes)."""
    from music3serve.serving import song_service

    async def events():
        yield AudioChunk("tail", 0, np.full((2, 4410), 0.1, np.float32), False)
        yield Done("tail", 1, "budget", {})

    async def scenario():
        engine = SimpleNamespace(progress=lambda song: None)  # the song's progress: not known
        song = song_service.SongState("tail", 1, 100, "pcm", 32000)
        service = song_service.SongService(engine)  # type: ignore[arg-type]
        pieces = [piece async for piece in service.audio(song, events(), song_service.PcmEncoder(32000))]
        return song, pieces

    song, pieces = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert song.state == "done" and len(pieces) == 2  # the chunk's samples, then the tail
    assert sum(len(data) for data, _ in pieces) // 4 == sum(samples for _, samples in pieces) == 3200  # 0.1 s


def test_a_window_is_encoded_and_sent_in_slices_equal_to_it_whole():
    """A window reaches the encoder half a second at a time and each slice's bytes leave once encoded (a song's first
    audio waits for one slice's encoding, not its window's); the bytes equal the window encoded in one piece."""
    from music3serve.serving import song_service

    window = np.random.default_rng(0).uniform(-1, 1, (2, 2 * 44100 + 7)).astype(np.float32)

    async def events():
        yield AudioChunk("sliced", 0, window, True)
        yield Done("sliced", 50, "budget", {})

    async def scenario():
        engine = SimpleNamespace(progress=lambda song: None)  # the song's progress: not known
        song = song_service.SongState("sliced", 1, 100, "pcm", 32000)
        service = song_service.SongService(engine)  # type: ignore[arg-type]
        return song, [piece async for piece in service.audio(song, events(), song_service.PcmEncoder(32000))]

    _, pieces = asyncio.run(asyncio.wait_for(scenario(), 30))
    data = b"".join(data for data, _ in pieces)
    assert len(pieces) == 5 and data == song_service.PcmEncoder(32000).feed(window, True)
    assert [len(data) // 4 for data, _ in pieces] == [samples for _, samples in pieces]  # each piece's own samples


def test_pcm_stream_is_raw_interleaved_s16le(client, songs):
    with client.stream("POST", "/v1/songs", json={**SONG, "duration": SHORT, "format": "pcm"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/octet-stream"
        assert (response.headers["x-sample-rate"], response.headers["x-channels"]) == ("44100", "2")
        body = response.read()
    assert len(body) == songs[SHORT].shape[-1] * 4
    assert_close_pcm(samples(body), to_pcm16(songs[SHORT]))


def test_non_streaming_response_is_a_complete_wav(client, songs):
    response = client.post("/v1/songs", json={**SONG, "duration": SHORT, "stream": False, "sample_rate": 32000})
    assert response.status_code == 200 and response.headers["content-length"] == str(len(response.content))
    assert "x-accel-buffering" not in response.headers  # one body, sent whole: nothing for a proxy to hold back
    rate, pcm = parse_wav(response.content, streaming=False)
    with wave.open(io.BytesIO(response.content)) as f:
        assert (f.getframerate(), f.getnchannels(), f.getnframes()) == (32000, 2, len(pcm))
    assert len(pcm) == math.ceil(songs[SHORT].shape[-1] * 320 / 441)
    assert_close_pcm(pcm, to_pcm16(resample(songs[SHORT], 44100, 32000)))


# --- errors -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, needle",
    [
        ({"caption": ""}, "caption"),
        ({"caption": "   "}, "caption"),
        ({"lyrics": None}, "lyrics"),
        ({"duration": 0}, "duration"),
        ({"duration": -3}, "duration"),
        ({"duration": 361}, "duration"),
        ({"duration": "ten"}, "duration"),
        ({"lyrics": "[verse]\n" + "la " * 6000}, "5000 tokens"),
        ({"format": "ogg"}, "format"),
        ({"sample_rate": 48000}, "sample_rate"),
        ({"seed": "1"}, "seed"),
        ({"seed": -1}, "seed: Input should be greater than or equal to 0"),  # the schema's words, not the engine's
        ({"seed": True}, "seed"),
        ({"steps": 0}, "steps: Input should be greater than or equal to 1"),
        ({"steps": 201}, "steps: Input should be less than or equal to 200"),
        ({"stream": "yes"}, "stream"),
        ({"temperature": 0.7}, "temperature"),
        ({"id": "has spaces"}, "id"),
        ({"id": ".."}, "cannot be reached"),
        ({"id": "."}, "cannot be reached"),
    ],
)
def test_bad_requests_are_400_and_never_reach_the_engine(client, change, needle):
    requests = metric(client, "music3_requests")
    response = client.post("/v1/songs", json={**SONG, "duration": SHORT, **change})
    assert response.status_code == 400
    assert needle in response.json()["error"]
    assert metric(client, "music3_requests") == requests


def test_a_prompt_the_talker_refuses_is_a_400_with_its_reason(client, engine, monkeypatch):
    """The talker's own checks (say a prompt that leaves no frames within max_model_len) refuse a song after the
    engine queued it: still a 400 with the talker's message, counted as an invalid request, not a 500."""

    def refuse(*args):
        raise InputError("the prompt has 9 tokens and leaves no frames within max_model_len 9")

    monkeypatch.setattr(engine.talker, "submit", refuse)
    invalid = metric(client, "music3_refusals", 'reason="invalid"')
    response = client.post("/v1/songs", json={**SONG, "duration": SHORT})
    assert response.status_code == 400
    assert response.json()["error"] == "the prompt has 9 tokens and leaves no frames within max_model_len 9"
    assert metric(client, "music3_refusals", 'reason="invalid"') == invalid + 1


def test_refusals_and_held_songs_are_exported(client):
    """A request the engine refuses (a blank caption passes the schema) counts under reason="invalid"; the gauges
    of held and waiting songs are there, at zero when idle."""
    invalid = metric(client, "music3_refusals", 'reason="invalid"')
    assert client.post("/v1/songs", json={**SONG, "caption": "   "}).status_code == 400
    assert metric(client, "music3_refusals", 'reason="invalid"') == invalid + 1
    text = client.get("/metrics").text
    for series in ('music3_refusals_total{reason="busy"}', 'music3_refusals_total{reason="unavailable"}',
                   "music3_songs_held 0.0", "music3_songs_waiting 0.0"):
        assert re.search(rf"^{re.escape(series)}", text, re.MULTILINE), series


def test_malformed_json_and_unknown_routes(client):
    response = client.post("/v1/songs", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]
    response = client.post("/v1/songs", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "the body is empty" in response.json()["error"]
    huge = b'{"seed": ' + b"9" * (sys.get_int_max_str_digits() + 700) + b"}"
    response = client.post("/v1/songs", content=huge, headers={"content-type": "application/json"})
    digits = sys.get_int_max_str_digits()
    assert response.status_code == 400 and f"a number has more than {digits} digits" in response.json()["error"]
    for path in ("/v1/nothing", "/redoc"):  # /docs and /openapi.json are served (tests/test_openapi.py)
        assert client.get(path).status_code == 404, path
    for method in ("GET", "DELETE"):  # an id with an encoded slash is a path of its own, named (it said "Not Found")
        response = client.request(method, "/v1/songs/a%2Fb")
        assert response.status_code == 404 and response.json()["error"] == (
            "there is no '/v1/songs/a/b' here; the paths this server has are listed at /openapi.json")
    assert client.post("/v1/nothing").status_code == 404  # no body asked for: not 411
    assert client.post("/health").status_code == 405
    assert client.get("/v1/songs/never-seen").status_code == 404
    longest = "a" * 128  # the longest id is quoted whole; a longer path is cut short, not echoed whole
    assert client.get(f"/v1/songs/{longest}").json()["error"] == f"no song {longest!r} is running or finished recently"
    error = client.get(f"/v1/songs/{'b' * 5000}").json()["error"]
    assert error == f"no song '{'b' * 131} is running or finished recently", error
    for method, path in (("GET", "/health/"), ("GET", "/v1/songs/"), ("DELETE", "/v1/songs/"), ("POST", "/v1/songs/")):
        response = client.request(method, path, follow_redirects=False)  # not a 307 to the path without the slash
        assert response.status_code == 404 and response.json()["error"], (method, path)


# --- cancellation and failure -----------------------------------------------------------------------------
def test_delete_cancels_a_streaming_song(client, engine):
    requests, failures = metric(client, "music3_requests"), metric(client, "music3_failures")
    frames, cancels = metric(client, "music3_frames"), metric(client, "music3_cancels")
    with client.stream("POST", "/v1/songs", json={**SONG, "duration": 60}) as response:
        assert response.status_code == 200
        song = response.headers["x-song-id"]
        pieces = response.iter_bytes()
        body = next(pieces)
        while len(body) <= 44:  # past the header: the first window has arrived
            body += next(pieces)
        assert client.delete(f"/v1/songs/{song}").status_code == 204
        body += b"".join(pieces)  # the stream ends cleanly, short of the song
    seconds = (len(body) - 44) / 4 / contract.SAMPLE_RATE
    assert 0 < seconds < 20
    assert client.get(f"/v1/songs/{song}").json()["state"] == "cancelled"
    poll_until(lambda: engine_idle(engine, song))

    def talker_steps_stand_still() -> bool:  # the loop counts a step just after it returns: one may still be counted
        steps = metric(client, "music3_talker_steps")
        time.sleep(0.3)
        return metric(client, "music3_talker_steps") == steps

    poll_until(talker_steps_stand_still, seconds=5.0)  # the talker stopped writing it
    assert metric(client, "music3_requests") == requests + 1
    assert metric(client, "music3_failures") == failures  # a cancel is not a failure
    assert metric(client, "music3_cancels") == cancels + 1  # the DELETE, not again for its stream closing
    assert metric(client, "music3_frames") >= frames + seconds * contract.FRAME_RATE  # a cancelled song's count too
    assert client.delete(f"/v1/songs/{song}").status_code == 204  # idempotent


def test_client_disconnect_cancels_the_song(client, engine):
    with client.stream("POST", "/v1/songs", json={**SONG, "duration": 60}) as response:
        song, pieces = response.headers["x-song-id"], response.iter_raw()  # (a dropped iterator would disconnect)
        assert next(pieces)[:4] == b"RIFF"
        poll_until(lambda: song in {caller_id(s.id) for s in engine.talker.active})  # it holds talker rows
    # Leaving the block closes the connection with the body unread.
    poll_until(lambda: client.get(f"/v1/songs/{song}").json()["state"] == "cancelled")
    poll_until(lambda: engine_idle(engine, song))  # its rows freed, the talker idle
    assert re.search(r"^music3_songs_held 0\.0$", client.get("/metrics").text, re.MULTILINE)


def test_a_delete_after_the_engine_finished_the_song_changes_nothing(client, engine, monkeypatch):
    """A DELETE that lands while the song's last audio is still on its way to the client (the engine has finished
    it and its Done waits to be read) stopped nothing in the engine, yet counted as a cancel and cut the stream short
    of its end ('cancelled'): the song counted as finished and as cancelled."""
    from music3serve.serving import song_service

    def finished() -> float:
        return engine.metrics.registry.get_sample_value("music3_song_seconds_count")

    def engine_done() -> bool:  # its Done is out (counted in music3_song_seconds as its stream closes)
        key = engine.held.key_of("late-delete")
        return key is not None and engine.held.client(key).done_s is not None

    # the server busy with the last window at the DELETE
    busy, release = hold(monkeypatch, song_service.PcmEncoder, "feed")
    before, cancels = finished(), metric(client, "music3_cancels")
    with client.stream("POST", "/v1/songs", json={**SONG, "duration": SHORT, "id": "late-delete"}) as response:
        poll_until(lambda: busy.is_set() and engine_done())  # one window: the engine is done with it
        assert client.delete("/v1/songs/late-delete").status_code == 204
        release.set()
        body = response.read()
    status = client.get("/v1/songs/late-delete").json()
    assert (status["state"], status["frames"]) == ("done", 50) and len(body) == 44 + 4 * status["samples_sent"]
    assert metric(client, "music3_cancels") == cancels and finished() == before + 1


def test_a_song_cancelled_while_its_last_window_renders_does_not_count_as_finished(engine, monkeypatch):
    """The window rendered after the cancel still reached a caller that had not closed its stream (say one that
    broke out of its loop on Failed): its audio and Done were sent and the song counted as finished too."""
    rendering, release = hold(monkeypatch, engine.renderer, "render")
    sample = engine.metrics.registry.get_sample_value
    finished, windows = sample("music3_song_seconds_count"), sample("music3_windows_total")

    async def scenario() -> None:
        events = engine.submit(SongRequest(SONG["caption"], SONG["lyrics"], SHORT, 0, SONG["steps"], id="cut-late"))
        assert isinstance(await anext(events), Accepted)
        assert await asyncio.to_thread(rendering.wait, 30)
        engine.cancel("cut-late")
        assert (await anext(events)).message == "cancelled"
        release.set()
        await asyncio.to_thread(poll_until, lambda: sample("music3_windows_total") == windows + 1)
        await events.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert sample("music3_song_seconds_count") == finished


def test_delete_cancels_a_non_streaming_song(base_url, client, engine):
    outcome = {}

    def post():
        with httpx.Client(base_url=base_url, timeout=TIMEOUT) as other:
            body = {**SONG, "duration": 60, "stream": False, "id": "whole-1"}
            outcome["response"] = other.post("/v1/songs", json=body)

    thread = threading.Thread(target=post)
    thread.start()
    poll_until(lambda: client.get("/v1/songs/whole-1").status_code == 200)
    assert client.delete("/v1/songs/whole-1").status_code == 204
    thread.join(timeout=30)
    assert not thread.is_alive()
    response = outcome["response"]
    assert response.status_code == 409 and "cancelled" in response.json()["error"]
    poll_until(lambda: engine_idle(engine, "whole-1"))


def test_a_whole_song_cut_at_shutdown_gets_a_json_503(engine, client):
    """A stream: false song still running when the shutdown grace is over is answered with a JSON 503 that says so
    (uvicorn's cancel gave a plain-text 500)."""
    import socket

    import uvicorn

    from music3serve.serving.api import create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_config=None, log_level="critical", lifespan="off",
                                           timeout_graceful_shutdown=0.2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    poll_until(lambda: server.started)
    url, outcome = f"http://127.0.0.1:{sock.getsockname()[1]}", {}

    def post():
        with httpx.Client(base_url=url, timeout=TIMEOUT) as other:
            outcome["response"] = other.post("/v1/songs", json={**SONG, "duration": 60, "stream": False, "id": "cut-1"})

    poster = threading.Thread(target=post)
    poster.start()
    try:
        poll_until(lambda: engine.held.key_of("cut-1") is not None)
        server.should_exit = True
        poster.join(timeout=30)
        thread.join(timeout=30)
    finally:
        sock.close()
    response = outcome["response"]
    assert response.status_code == 503 and response.headers["content-type"] == "application/json"
    assert response.json()["error"].startswith("the server shut down before song cut-1 was finished")
    poll_until(lambda: engine_idle(engine, "cut-1"))


def test_a_streamed_song_cut_at_shutdown_ends_short_and_frees_its_rows(engine, serve_http):
    """A streamed song still running when the shutdown grace is over: its client sees an incomplete body (not a
    song that merely ended early), and the engine drops the song."""
    from music3serve.serving.api import create_app

    got, cancels = [], engine.metrics.registry.get_sample_value("music3_cancels_total")

    def listen(url: str) -> None:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as other:
            with other.stream("POST", "/v1/songs", json={**SONG, "duration": 60, "id": "cut-stream"}) as response:
                try:
                    for piece in response.iter_bytes():
                        got.append(piece)
                except httpx.RemoteProtocolError as exc:
                    got.append(exc)

    with serve_http(create_app(engine), timeout_graceful_shutdown=0.2) as url:
        listener = threading.Thread(target=listen, args=(url,))
        listener.start()
        poll_until(lambda: sum(len(p) for p in got if isinstance(p, bytes)) > 44)  # audio is flowing
    listener.join(30)
    assert isinstance(got[-1], httpx.RemoteProtocolError)
    poll_until(lambda: engine_idle(engine, "cut-stream"))
    assert engine.metrics.registry.get_sample_value("music3_songs_held") == 0
    assert engine.metrics.registry.get_sample_value("music3_cancels_total") == cancels + 1


def test_a_failure_mid_stream_drops_the_connection(client, engine, monkeypatch):
    def broken(batch):
        raise RuntimeError("out of tiny memory")

    monkeypatch.setattr(engine.renderer, "render", broken)
    failures = metric(client, "music3_failures")
    with client.stream("POST", "/v1/songs", json={**SONG, "duration": SHORT}) as response:
        assert response.status_code == 200  # accepted: the failure comes after the headers
        song = response.headers["x-song-id"]
        with pytest.raises(httpx.RemoteProtocolError):
            response.read()
    status = client.get(f"/v1/songs/{song}").json()
    assert status["state"] == "failed" and "out of tiny memory" in status["error"]
    assert metric(client, "music3_failures") == failures + 1


def http10_song(base_url: str, song_id: str) -> tuple[bytes, bool]:
    """A streamed song asked for over HTTP/1.0 on a raw socket: what came, and whether the connection was reset."""
    import socket

    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps({**SONG, "duration": SHORT, "id": song_id}).encode()
    answer = b""
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(b"POST /v1/songs HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            while data := conn.recv(65536):
                answer += data
        except ConnectionResetError:
            return answer, True
    return answer, False


def test_over_http_1_0_a_failed_stream_is_reset_and_a_finished_one_ends_cleanly(serve_http, engine, monkeypatch,
                                                                              caplog):
    """HTTP/1.0 has no chunked encoding, so a stream cut by its song's failure ended with a plain close, which reads
    as a whole (short) song: through a proxy that speaks HTTP/1.0 upstream (nginx's default) every failed song
    reached its listener as a finished one. The connection is reset instead (by the server's protocol, as
    `music3serve serve` runs it), and uvicorn's traceback for the cut is one warning line."""
    from music3serve.serving.api import create_app
    from music3serve.serving.song_stream import CutResponses
    from music3serve.serving.http_guard import guarded_protocol

    def broken(batch):
        raise RuntimeError("out of tiny memory")

    uvicorn_log = logging.getLogger("uvicorn.error")
    monkeypatch.setattr(uvicorn_log, "filters", [*uvicorn_log.filters, CutResponses()])  # as serve() installs it
    with serve_http(create_app(engine), http=guarded_protocol(None)) as base_url:
        answer, reset = http10_song(base_url, "http10-done")
        assert answer.startswith(b"HTTP/1.1 200 ") and not reset
        assert httpx.get(f"{base_url}/v1/songs/http10-done").json()["state"] == "done"
        monkeypatch.setattr(engine.renderer, "render", broken)
        with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
            answer, reset = http10_song(base_url, "http10-failed")
        assert answer.startswith(b"HTTP/1.1 200 ") and reset
        assert httpx.get(f"{base_url}/v1/songs/http10-failed").json()["state"] == "failed"
    cut = [r for r in caplog.records if r.name == "uvicorn.error" and "http10-failed" in r.getMessage()]
    assert [(r.levelname, r.exc_info) for r in cut] == [("WARNING", None)], cut
    assert cut[0].getMessage().startswith("a response was cut: song http10-failed failed after 0 samples")


def test_a_whole_song_that_fails_answers_500_with_the_reason(client, engine, monkeypatch):
    """stream: false and the render fails: a 500 saying the song failed and why (not a 409 "cancelled")."""

    def broken(batch):
        raise RuntimeError("out of tiny memory")

    monkeypatch.setattr(engine.renderer, "render", broken)
    response = client.post("/v1/songs", json={**SONG, "duration": SHORT, "stream": False, "id": "whole-fails"})
    assert response.status_code == 500
    assert response.json()["error"] == "song whole-fails failed: stage 1 failed: out of tiny memory"
    assert client.get("/v1/songs/whole-fails").json()["state"] == "failed"


# --- service endpoints and wiring -------------------------------------------------------------------------
def test_a_delete_before_acceptance_answers_409(client, engine, monkeypatch, caplog):
    """DELETE of an id whose POST is still waiting for the engine to accept it: the POST answers 409 (not 400)."""
    caplog.set_level(logging.INFO)
    real_submit = engine.talker.submit

    def slow_submit(*args, **kwargs):  # a talker busy with a long prefill step
        time.sleep(1.0)
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(engine.talker, "submit", slow_submit)
    post = threading.Thread(target=lambda: result.append(client.post("/v1/songs", json={**SONG, "id": "early"})))
    result: list = []
    post.start()
    poll_until(lambda: engine.held.key_of("early") is not None)
    assert client.delete("/v1/songs/early").status_code == 204
    post.join(60)
    assert result[0].status_code == 409 and "cancelled before it was accepted" in result[0].json()["error"]
    assert [r.song for r in caplog.records if r.getMessage() == "song cancelled before it was accepted"] == ["early"]


def test_a_song_not_accepted_in_time_answers_503_and_leaves_nothing_behind(client, engine, monkeypatch):
    from music3serve.serving import song_service

    monkeypatch.setattr(song_service, "ACCEPT_TIMEOUT_S", 0.5)
    real_submit = engine.talker.submit

    def stuck_submit(*args, **kwargs):  # a talker stuck for longer than the acceptance wait
        time.sleep(2.0)
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(engine.talker, "submit", stuck_submit)
    response = client.post("/v1/songs", json={**SONG, "duration": SHORT, "id": "stuck"})
    assert response.status_code == 503 and "did not take the song within 0.5 s" in response.json()["error"]
    poll_until(lambda: engine_idle(engine, "stuck"))


def test_health_and_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    head = client.head("/health")
    assert head.status_code == 200 and head.content == b""
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "music3_requests_total" in response.text and "music3_first_audio_seconds" in response.text


def test_the_server_and_audio_file_packages_stay_out_of_the_engine_core():
    """The engine core runs without the server's packages (the GPU machine has none of them), and without PyAV."""
    root = Path(cli.__file__).parent
    users = {p.relative_to(root).as_posix() for p in root.rglob("*.py") if re.search(
        r"^\s*(from|import) (fastapi|starlette|uvicorn|pydantic)\b", p.read_text(encoding="utf-8"), re.MULTILINE)}
    endpoints = {"serving/openai_speech.py", "serving/music_generation.py"}
    service = "serving/song_service.py"
    assert users == {"serving/api.py", service, "serving/request_body.py", "serving/http_guard.py", "serving/server.py",
                     "serving/access.py", "serving/song_stream.py", "serving/web.py", "serving/error_bodies.py",
                     "serving/openapi_docs.py", "serving/ray_app.py", "bench/ray_replicas.py", *endpoints}
    for module, readers in (("request_body", {"serving/api.py", service, *endpoints}),
                            ("error_bodies", {"serving/api.py", service, "serving/access.py", "serving/http_guard.py",
                                              "serving/body_limits.py", "serving/openapi_docs.py", *endpoints}),
                            ("body_limits", {"serving/api.py", "serving/http_guard.py"}),
                            ("http_guard", {"serving/server.py"}),
                            ("access", {"serving/api.py", service, "serving/server.py", "serving/openapi_docs.py",
                                        "serving/ray_app.py", "serving/ray_front.py",
                                        "cli.py"}),  # cli: in `serve` only
                            ("openapi_docs", {"serving/api.py", *endpoints}),
                            ("song_stream", {service, "serving/server.py", "serving/http_guard.py"}),
                            ("web", {"serving/api.py"}),
                            ("api", {"serving/server.py", "serving/ray_app.py", "bench/ray_replicas.py"}),
                            # the endpoints: SongService, for type checkers only
                            ("song_service", {"serving/api.py", "serving/ray_front.py", *endpoints}),
                            ("server", {"cli.py", "serving/ray_app.py"})):  # cli: inside `serve` only
        importers = {p.relative_to(root).as_posix() for p in root.rglob("*.py")
                     if re.search(rf"^\s*(from|import) \S*\b{module}\b", p.read_text(encoding="utf-8"), re.MULTILINE)}
        assert importers == readers, module
    # soundfile (audio files) only inside the one function that reads or writes a file, imported when called.
    soundfile = {p.relative_to(root).as_posix() for p in root.rglob("*.py")
                 if re.search(r"^\s*(from|import) soundfile\b", p.read_text(encoding="utf-8"), re.MULTILINE)}
    assert soundfile == {"serving/audio_io.py"}
    assert not re.search(r"^(from|import) soundfile\b", (root / "serving/audio_io.py").read_text(encoding="utf-8"),
                         re.MULTILINE)
    # PyAV likewise, in serving/encoders.py, when a song asks for a format it encodes.
    av = {p.relative_to(root).as_posix() for p in root.rglob("*.py")
          if re.search(r"^\s*(from|import) av\b", p.read_text(encoding="utf-8"), re.MULTILINE)}
    assert av == {"serving/encoders.py"}
    encoders = (root / "serving/encoders.py").read_text(encoding="utf-8")
    assert not re.search(r"^(from|import) av\b", encoders, re.MULTILINE)


def test_cli_serve_builds_the_engine_and_runs_uvicorn(monkeypatch, tmp_path, root_logger):
    calls = {}

    class FakeEngine:
        max_songs = 1024

        def close(self):
            calls["closed"] = True

    def from_pretrained(root, deploy, device, progress):
        calls["engine"] = (Path(root), deploy.stages[0].max_num_seqs, device)
        return FakeEngine()

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(from_pretrained))
    from music3serve.serving.server import ForceQuitServer

    monkeypatch.setattr(ForceQuitServer, "run", lambda self, sockets=None: calls.update(vars(self.config)))
    assert cli.main(["serve", "--model", str(tmp_path), "--device", "cpu", "--port", "8123"]) == 0
    assert calls["engine"] == (tmp_path, 16, "cpu") and calls["closed"]
    from music3serve.serving.song_stream import CutResponses

    assert any(isinstance(f, CutResponses) for f in logging.getLogger("uvicorn.error").filters)
    assert (calls["host"], calls["port"]) == ("127.0.0.1", 8123)
    from music3serve.serving.http_guard import AcceptErrorsOncePerMinute, GuardedH11Protocol

    assert issubclass(calls["http"], GuardedH11Protocol)
    assert any(isinstance(f, AcceptErrorsOncePerMinute) for f in logging.getLogger("asyncio").filters)
    assert {r.path for r in calls["app"].routes} >= {"/v1/songs", "/v1/songs/{song_id}", "/health", "/metrics"}


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signal handlers: main thread")
def test_a_ctrl_c_while_the_engine_loads_stops_serve_also_where_sigint_was_ignored(monkeypatch, tmp_path, capsys):
    """A script's background job starts with SIGINT ignored: uvicorn takes Ctrl-C once it runs, but one sent while
    the weights loaded (minutes at full size) was dropped and the server started all the same."""
    import signal

    def from_pretrained(root, deploy, device, progress):
        signal.raise_signal(signal.SIGINT)
        pytest.fail("the Ctrl-C did not stop the loading")

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(from_pretrained))
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert cli.main(["serve", "--model", str(tmp_path), "--device", "cpu", "--port", "8124"]) == 130
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # given back as it was
    finally:
        signal.signal(signal.SIGINT, before)
    assert capsys.readouterr().err.endswith("interrupted\n")


def test_serve_lifts_the_soft_limit_on_open_files_so_every_songs_connection_fits(monkeypatch):
    """A systemd service gets a soft limit of 1024 open files: short of 1024 songs' connections, so a flood of
    clients found the server out of files before its 429s (clients waited unanswered, EMFILE logged in a loop)."""
    resource = pytest.importorskip("resource")
    from music3serve.serving import server

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 2 * MAX_SONGS:
        pytest.skip(f"needs a finite hard limit on open files of at least {2 * MAX_SONGS}")
    monkeypatch.setattr(server.ForceQuitServer, "run", lambda self, sockets=None: None)
    engine = SimpleNamespace(max_songs=MAX_SONGS)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        server.serve(engine)  # type: ignore[arg-type]
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert engine.max_songs == MAX_SONGS


def test_serve_holds_fewer_songs_when_the_hard_limit_on_open_files_is_too_low(monkeypatch, caplog):
    resource = pytest.importorskip("resource")
    from music3serve.serving import server

    limits, served = [(300, 600)], {}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits[-1])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.append(value))
    monkeypatch.setattr(server.ForceQuitServer, "run", lambda self, sockets=None: served.update(vars(self.config)))
    engine = SimpleNamespace(max_songs=MAX_SONGS)
    server.serve(engine)  # type: ignore[arg-type]
    assert limits[-1] == (600, 600) and engine.max_songs == 600 - server.FILES_RESERVE  # past them: 429, not a hang
    assert "too few open files" in caplog.text
    # Connections beyond the songs' are capped below the limit too (serving/http_guard.py): accept() never runs out.
    assert served["http"].max_connections == 600 - server.ENGINE_FILES > engine.max_songs


def test_cli_serve_without_fastapi_says_what_to_install(monkeypatch, capsys, root_logger):
    for module in ("music3serve.serving.api", "music3serve.serving.server"):  # import them afresh, without uvicorn
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert cli.main(["serve", "--tiny"]) == 2
    assert "pip install -e '.[serve]'" in capsys.readouterr().err


def test_a_client_that_stops_reading_has_its_song_cancelled(monkeypatch):
    """A send that does not complete within WRITE_STALL_S (the client's socket is full: it reads nothing) stops the
    song and closes the body generator, instead of holding the song forever."""
    from music3serve.serving import song_service, song_stream

    monkeypatch.setattr(song_stream, "WRITE_STALL_S", 0.2)
    monkeypatch.setattr(song_stream.CutResponses, "stalled", 0)
    closed = []

    async def body():
        try:
            while True:
                yield b"x" * 1024, 256
        finally:
            closed.append(True)

    async def scenario():
        song = song_service.SongState("stalled", 1, 100, "pcm", 44100)
        sends = []

        async def send(message):
            sends.append(message["type"])
            if len(sends) > 2:  # the headers and one piece go out, then the client's window is full
                await asyncio.Event().wait()

        async def receive():
            await asyncio.Event().wait()  # no disconnect is ever seen

        async def abandon() -> None:  # the service's: close the engine stream, record the song as ended
            closed.append("abandoned")

        def gone() -> None:  # the service's: cancel the song
            closed.append("gone")

        stream = song_stream.SongStream(body(), song, gone, abandon)
        await asyncio.wait_for(stream({"type": "http"}, receive, send), 5)
        return song, sends

    song, sends = asyncio.run(scenario())
    assert closed == ["gone", True, "abandoned"]  # the song cancelled, the body closed, then the song ended
    assert song_stream.CutResponses.stalled == 1  # uvicorn's line about the unfinished response becomes a warning
    assert sends == ["http.response.start", "http.response.body", "http.response.body"]


# --- server-side failures, abandoned streams, logs -------------------------------------------------------
def test_a_failing_submit_fails_that_song_with_a_5xx_and_the_engine_serves_on(client, engine, monkeypatch):
    """A non-input error while stage 0 takes a song (say a device error while queueing it) is the server's fault: that
    POST gets a 500, and the next song is served (it killed the talker thread: every later song got 503)."""
    real = engine.talker.submit

    def flaky(song, *args, **kwargs):
        if song.startswith("oom#"):  # the stages know a song as "<id>#<n>"
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real(song, *args, **kwargs)

    monkeypatch.setattr(engine.talker, "submit", flaky)
    first = client.post("/v1/songs", json={**SONG, "duration": SHORT, "stream": False, "id": "oom"})
    assert first.status_code == 500 and "out of memory" in first.json()["error"]
    second = client.post("/v1/songs", json={**SONG, "duration": SHORT, "stream": False})
    assert second.status_code == 200
    assert engine.unavailable() is None


def test_an_engine_closing_before_acceptance_answers_503(tiny_dir: Path, serve_http, monkeypatch):
    """The server shutting down while a POST waits for acceptance: 503 (retry elsewhere), not 400 (your fault)."""
    from music3serve.serving.api import create_app

    engine = Engine.from_pretrained(tiny_dir, device="cpu")
    real_submit = engine.talker.submit

    def slow_submit(*args, **kwargs):  # a talker busy with a long prefill step
        time.sleep(1.0)
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(engine.talker, "submit", slow_submit)
    result: list = []
    try:
        with serve_http(create_app(engine)) as url:
            def post() -> None:
                with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
                    result.append(c.post("/v1/songs", json={**SONG, "id": "closing"}))

            thread = threading.Thread(target=post)
            thread.start()
            poll_until(lambda: engine.held.key_of("closing") is not None)
            engine.close()
            thread.join(30)
    finally:
        engine.close()
    assert result[0].status_code == 503, result[0].text


class HeldSong:
    """An engine whose one song is accepted and then waits forever (until its stream is closed)."""

    def __init__(self):
        self.closed = False

    async def submit(self, request):
        try:
            yield Accepted(request.id, 1, 100, 10)
            await asyncio.Event().wait()
        finally:
            self.closed = True

    def cancel(self, song: str) -> bool:
        return True  # it holds the song until its stream is closed


def test_a_stream_whose_headers_cannot_be_sent_ends_its_song():
    """An ASGI server raising on the first send (a client gone before the headers; ASGI 2.4 servers raise): the
    body never starts, so its cleanup never ran and the song stayed 'running' with its engine stream open."""
    from music3serve.serving import song_service

    async def scenario():
        engine = HeldSong()
        service = song_service.SongService(engine)  # type: ignore[arg-type]
        request = song_service.Request({"type": "http", "headers": []})
        response = await service.create(song_service.SongBody(caption="pop", lyrics="la", id="gone"), request)
        assert isinstance(response, song_service.SongStream) and response.headers["x-song-id"] == "gone"

        async def send(message):
            raise OSError("client disconnected")

        async def receive():
            await asyncio.Event().wait()

        await asyncio.wait_for(response({"type": "http", "headers": []}, receive, send), 5)
        return service, engine

    service, engine = asyncio.run(scenario())
    assert service.songs.lookup("gone").state == "cancelled" and "gone" not in service.songs.running
    assert engine.closed


def test_a_reused_ids_newest_result_is_kept_longest(monkeypatch):
    from music3serve.serving import song_registry, song_service

    monkeypatch.setattr(song_registry, "KEEP_FINISHED", 2)
    service = song_service.SongService(None)  # type: ignore[arg-type]
    for song_id in ("a", "b", "a", "c"):  # "a" runs again after "b", then "c"
        song = song_service.SongState(song_id, 1, 100, "wav", 44100)
        service.songs.running[song_id] = song
        service.songs.finish(song, "done")
    assert service.songs.lookup("a") is not None and service.songs.lookup("c") is not None
    assert service.songs.lookup("b") is None


def test_a_served_song_is_logged_under_its_id_once_it_ends(client, caplog):
    caplog.set_level("INFO", logger="music3serve.serving")
    response = client.post("/v1/songs", json={**SONG, "duration": SHORT, "stream": False, "id": "logged-1"})
    assert response.status_code == 200
    ended = [r for r in caplog.records if r.getMessage() == "song ended" and getattr(r, "song", None) == "logged-1"]
    assert len(ended) == 1 and ended[0].state == "done" and ended[0].frames == int(response.headers["x-frame-budget"])
    poll_until(lambda: any(r.getMessage() == "song response ended" for r in caplog.records))  # sent after it ended
    sent = [r for r in caplog.records if r.getMessage() == "song response ended" and r.song == "logged-1"]
    assert len(sent) == 1 and sent[0].delivered is True and 4 * sent[0].samples == len(response.content) - 44


def test_streams_cut_at_shutdown_log_one_warning_line_not_a_traceback():
    from music3serve.serving.song_stream import CutResponses

    def record(error: BaseException) -> logging.LogRecord:
        try:
            raise error
        except BaseException:
            return logging.getLogger("uvicorn.error").makeRecord(
                "uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application\n", (), sys.exc_info())

    cut = record(asyncio.CancelledError("Task cancelled, timeout graceful shutdown exceeded"))
    assert CutResponses().filter(cut) and cut.levelno == logging.WARNING and cut.exc_info is None
    assert "cut at shutdown" in logging.Formatter().format(cut) and "Traceback" not in logging.Formatter().format(cut)
    announced = logging.getLogger("uvicorn.error").makeRecord(
        "uvicorn.error", logging.ERROR, __file__, 1, "Cancel %s running task(s), timeout graceful shutdown exceeded",
        (2,), None)
    assert CutResponses().filter(announced) and announced.levelno == logging.WARNING
    assert announced.getMessage().startswith("Cancel 2 running task(s), timeout graceful shutdown exceeded")
    for error in RuntimeError("a real bug"), asyncio.CancelledError():  # only the shutdown's own cancellation
        other = record(error)
        assert CutResponses().filter(other) and other.levelno == logging.ERROR and other.exc_info is not None


def test_a_stream_cut_for_a_stalled_client_logs_a_warning_not_an_error(monkeypatch):
    """SongStream ends the response of a client that stopped reading unfinished, which uvicorn logged as an ERROR;
    an unfinished response with no stall behind it stays one."""
    from music3serve.serving.song_stream import CutResponses

    def record() -> logging.LogRecord:
        return logging.getLogger("uvicorn.error").makeRecord(
            "uvicorn.error", logging.ERROR, __file__, 1, "ASGI callable returned without completing response.", (),
            None)

    monkeypatch.setattr(CutResponses, "stalled", 0)
    unexplained = record()
    assert CutResponses().filter(unexplained) and unexplained.levelno == logging.ERROR
    CutResponses.stalled = 1  # SongStream gave up on a stalled client
    cut = record()
    assert CutResponses().filter(cut) and cut.levelno == logging.WARNING
    assert "its client stopped reading" in cut.getMessage() and CutResponses.stalled == 0


def test_a_second_ctrl_c_still_cuts_the_streams_and_closes_the_engine_quietly(tiny_dir: Path, caplog):
    """uvicorn's force quit (a second Ctrl-C) skips the app's shutdown: the engine was left open and the event
    loop's teardown cancelled the streams, logging a traceback for each and one for the app."""
    import socket

    from music3serve.serving.api import create_app
    from music3serve.serving.song_stream import CutResponses
    from music3serve.serving.server import ForceQuitServer

    own = Engine.from_pretrained(tiny_dir, device="cpu")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = ForceQuitServer(uvicorn.Config(create_app(own, close_engine=True), log_config=None, log_level="info"))
    logging.getLogger("uvicorn.error").addFilter(cut := CutResponses())
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    got: list = []

    def listen() -> None:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with httpx.Client(base_url=url, timeout=TIMEOUT) as other:
            with other.stream("POST", "/v1/songs", json={**SONG, "duration": 60, "id": "forced"}) as response:
                try:
                    got.extend(response.iter_bytes())
                except httpx.RemoteProtocolError as exc:
                    got.append(exc)

    listener = threading.Thread(target=listen)
    try:
        with caplog.at_level(logging.INFO):
            thread.start()
            poll_until(lambda: server.started)
            listener.start()
            poll_until(lambda: own.held.key_of("forced") is not None)
            server.force_exit = server.should_exit = True  # what uvicorn's handler sets on the second SIGINT
            thread.join(timeout=30)
            listener.join(timeout=30)
            closed_by_the_server = own.unavailable() == "the engine is closed"
            stages_left = [t.name for t in own._threads if t.is_alive()]
    finally:
        logging.getLogger("uvicorn.error").removeFilter(cut)
        sock.close()
        own.close()
    assert not thread.is_alive() and isinstance(got[-1], httpx.RemoteProtocolError)
    assert closed_by_the_server and not stages_left
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or "Traceback" in r.getMessage()]
    assert any("cut at shutdown" in r.getMessage() for r in caplog.records)


def test_ctrl_c_exits_130_also_where_the_server_started_with_sigint_ignored(tiny_dir: Path):
    """A script's background job starts with SIGINT ignored: uvicorn's re-raise of the Ctrl-C it had caught then did
    nothing, and the server exited 0 like a clean stop."""
    import os
    import signal
    import subprocess

    command = [sys.executable, "-m", "music3serve.cli", "serve", "--model", str(tiny_dir), "--device", "cpu", "--port",
               "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ignoring = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]  # as a script's background job starts it
    server = subprocess.Popen(ignoring + command, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    deadline = threading.Timer(120, server.kill)  # a server that never listens fails the test, not hangs it
    deadline.start()
    try:
        for line in server.stderr:  # the server's log, until it listens
            lines.append(line)
            if "Uvicorn running on" in line:
                break
        server.send_signal(signal.SIGINT)
        try:
            rest = server.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not stop within 60 s of Ctrl-C:\n" + "".join(lines))
    finally:
        deadline.cancel()
        server.kill()
        server.wait()
    assert server.returncode == 130, "".join(lines) + rest
    assert rest.endswith("interrupted\n"), rest
