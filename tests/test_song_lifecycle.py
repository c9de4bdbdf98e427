"""A song's life seen from a real client of a real server (the guarded h11 protocol `serve` runs, the tiny checkpoint
on the CPU): a client gone cancels its song wherever the song is, a song waiting for the talker's rows reads
"queued", a cancelled event stream ends with an error event, and lyrics dropped after a [tag] are named in a
header."""

from __future__ import annotations

import json
import socket

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from polling import hold, poll_until  # noqa: E402

SONG = {"caption": "synth pop, 120 bpm", "lyrics": "[verse]\nla la", "seed": 0, "steps": 2, "duration": 2}
MODEL = "MiniMax-Music3"
ORIGIN = "https://app.example"
SPEECH = {"model": MODEL, "input": SONG["lyrics"], "instructions": SONG["caption"], "max_new_tokens": 50, "seed": 0,
          "steps": 2, "response_format": "pcm"}
MUSIC = {"model": MODEL, "prompt": SONG["caption"], "lyrics": SONG["lyrics"], "max_new_tokens": 50, "seed": 0,
         "steps": 2, "audio_setting": {"format": "pcm"}}


@pytest.fixture(scope="module")
def base_url(engine, serve_http):
    from music3serve.serving.access import Access
    from music3serve.serving.api import create_app
    from music3serve.serving.http_guard import guarded_protocol

    with serve_http(create_app(engine, access=Access(allowed_origins=(ORIGIN,))), http=guarded_protocol(None)) as url:
        yield url


def post_bytes(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), len(data), data))


def connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def read_head(conn: socket.socket) -> bytes:
    """The response's head, read whole (as curl reads it), so that a close afterwards is a plain FIN, not a reset."""
    head = b""
    while b"\r\n\r\n" not in head:
        data = conn.recv(4096)
        assert data, head
        head += data
    return head


def state(client, song: str) -> str | None:
    return client.get(f"/v1/songs/{song}").json().get("state")


@pytest.mark.parametrize("where, path, body, leave", [
    ("queued", "/v1/songs", {**SONG, "duration": 60, "format": "pcm", "id": "gone-queued"}, "close"),
    ("whole", "/v1/songs", {**SONG, "duration": 60, "stream": False, "id": "gone-whole"}, "close"),
    ("whole", "/v1/songs", {**SONG, "duration": 60, "stream": False, "id": "gone-half"}, "half-close"),
    ("whole", "/v1/audio/speech", {**SPEECH, "max_new_tokens": 1500}, "close"),
])
def test_a_client_gone_cancels_its_song_at_once(base_url, client, engine, monkeypatch, where, path, body, leave):
    """A client that left (its curl killed: a clean close, which an end of input cannot be told apart from) was only
    noticed by the server's next write: a song waiting in the talker's queue stayed held until it reached a row and
    rendered its first window, and a whole song (`stream: false`, speech's default) rendered to its end. Now it is
    cancelled at once, wherever it is: its id and its rows are free, and it reads "cancelled"."""
    if where == "queued":
        monkeypatch.setattr(engine.talker.slots, "pairs", 0)  # no song gets rows: each waits in the talker's queue
    else:
        _, release = hold(monkeypatch, engine.renderer, "render")  # the song can never be done meanwhile
    cancels = engine.metrics.cancels._value.get()
    try:
        with connect(base_url) as conn:
            conn.sendall(post_bytes(path, body))
            poll_until(lambda: len(engine.held) == 1 and engine.talker.songs, 30)  # accepted by the talker
            if where == "queued":
                assert read_head(conn).startswith(b"HTTP/1.1 200"), "a streamed song's head goes out once accepted"
                assert state(client, body["id"]) == "queued"
            if leave == "half-close":
                conn.shutdown(socket.SHUT_WR)
                poll_until(lambda: len(engine.held) == 0, 5)
        poll_until(lambda: len(engine.held) == 0 and not engine.talker.songs, 5)
    finally:
        if where != "queued":
            release.set()
    assert engine.metrics.cancels._value.get() == cancels + 1
    if "id" in body:
        poll_until(lambda: state(client, body["id"]) == "cancelled", 5)


def test_a_song_reads_queued_until_the_talker_gives_it_rows(client, engine, monkeypatch):
    with client.stream("POST", "/v1/songs", json={**SONG, "duration": 60, "id": "waits"}) as response:
        assert response.status_code == 200
        pairs = engine.talker.slots.pairs
        monkeypatch.setattr(engine.talker.slots, "pairs", 0)
        with client.stream("POST", "/v1/songs", json={**SONG, "id": "queued"}) as queued:
            assert queued.status_code == 200
            status = client.get("/v1/songs/queued").json()
            assert status["state"] == "queued" and status["frames_written"] == 0, status
            monkeypatch.setattr(engine.talker.slots, "pairs", pairs)
            poll_until(lambda: state(client, "queued") in ("running", "done"), 30)
            assert state(client, "waits") == "running"
            queued.read()
        assert state(client, "queued") == "done"
        client.delete("/v1/songs/waits")


def sse_events(text: str) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("path, body", [("/v1/audio/speech", {**SPEECH, "stream_format": "sse"}),
                                        ("/v1/music_generation", {**MUSIC, "stream": True})])
def test_a_cancelled_event_stream_ends_with_an_error_event(client, engine, monkeypatch, path, body):
    """A DELETE ended the speech and hosted event streams after their deltas with no final event, so a client could
    not tell a cancel from a cut connection; now the last event says the song was cancelled, in each stream's own
    error shape."""
    started, release = hold(monkeypatch, engine.renderer, "render")
    try:
        with client.stream("POST", path, json={**body, "max_new_tokens": 1500}) as response:
            assert response.status_code == 200
            assert started.wait(30)
            assert client.delete(f"/v1/songs/{response.headers['x-song-id']}").status_code == 204
            last = sse_events(response.read().decode())[-1]
    finally:
        release.set()
    if path == "/v1/audio/speech":
        assert last["type"] == "error" and last["error"]["code"] == "cancelled", last
        assert "was cancelled" in last["error"]["message"]
    else:
        assert last["data"] is None and last["base_resp"]["status_code"] == 2013, last
        assert "was cancelled" in last["base_resp"]["status_msg"]


@pytest.mark.parametrize("path, body", [
    ("/v1/songs", {**SONG, "stream": False}), ("/v1/songs", SONG),
    ("/v1/audio/speech", SPEECH), ("/v1/music_generation", MUSIC),
])
def test_lyrics_dropped_after_a_tag_are_named_in_a_header(client, path, body):
    """The text after a [tag] on its line is dropped (as the reference does); it was only logged, so API clients had
    no sign. Lyrics of tags alone (an instrumental) are no error: the header names what was dropped, and a browser
    app may read it."""
    field = "input" if "input" in body else "lyrics"
    headers = {"Origin": ORIGIN}
    plain = client.post(path, json=body, headers=headers)
    assert plain.status_code == 200 and "x-dropped-lyrics-lines" not in plain.headers
    for lyrics, dropped in (("[verse] la la\nla\n[chorus] oh oh", "1,3"), ("[intro] soft piano", "1")):
        response = client.post(path, json={**body, field: lyrics}, headers=headers)
        assert response.status_code == 200, response.text
        assert response.headers["x-dropped-lyrics-lines"] == dropped
        assert "x-dropped-lyrics-lines" in response.headers["access-control-expose-headers"].lower()


def test_an_event_stream_cut_at_shutdown_ends_with_an_error_event(engine, serve_http, monkeypatch):
    """At shutdown an event stream still open when the grace period is over was cut after its deltas; now its last
    event says the server shut down (speech's error shape, code "server_shutdown")."""
    import threading

    from music3serve.serving.api import create_app

    started, release = hold(monkeypatch, engine.renderer, "render")
    lines: list[str] = []
    try:
        with serve_http(create_app(engine), timeout_graceful_shutdown=1) as url:

            def read() -> None:
                with httpx.stream("POST", f"{url}/v1/audio/speech", json={**SPEECH, "stream_format": "sse"},
                                  timeout=30) as response:
                    try:
                        lines.extend(response.iter_lines())
                    except httpx.HTTPError:
                        pass  # the connection is cut after the last event

            reader = threading.Thread(target=read)
            reader.start()
            assert started.wait(30)
        reader.join(30)
    finally:
        release.set()
    last = sse_events("\n".join(lines))[-1]
    assert last["type"] == "error" and last["error"]["code"] == "server_shutdown", last
