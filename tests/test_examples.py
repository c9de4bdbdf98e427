"""The clients in examples/ against a live server on the tiny checkpoint, run as their own instructions say:
play_stream.html in headless Chromium, served from an origin of its own that the server allows, plays the song while
it is written, its Stop cancels the song on the server, and it shows the server's refusals; curl.sh, openai_sdk.py
and hosted_api.py run at once (three users of one server) and write the songs they say they write."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
soundfile = pytest.importorskip("soundfile")
pytest.importorskip("av")

from music3serve.serving.access import Access, HostPolicy
from music3serve.serving.api import create_app
from decoding import assert_song_audio, expected_samples  # tests/ is on the import path (no package)
from polling import poll_until

EXAMPLES = Path(__file__).parents[1] / "examples"
README = Path(__file__).parents[1] / "README.md"
SCRIPT_FRAMES = 250  # the scripts' max_new_tokens and curl.sh's 10 s: each song runs to its cap on the tiny model
PAGE_SECONDS = 12  # 300 frames: the first window's audio leaves at frame 201, the last at 300
PAGE_SEED = 2**64 - 1  # the largest seed: past what a JavaScript number holds exactly
SPEECH_RATE = 32000  # /v1/audio/speech's default rate
BATCH_LSB = 6  # 16-bit steps between runs of one song in different batches (as tests/test_studio.py)


class QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def page_origin():
    """examples/ served as the page says (python -m http.server), on a free port: its origin."""
    with ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietFiles, directory=str(EXAMPLES))) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"http://localhost:{server.server_address[1]}"
        server.shutdown()


@pytest.fixture(scope="module")
def api_url(engine, serve_http, page_origin):
    """The API as `music3serve serve --allowed-origins <page origin>` runs it on 127.0.0.1."""
    access = Access(allowed_origins=(page_origin,), hosts=HostPolicy.for_bind("127.0.0.1"))
    with serve_http(create_app(engine, access=access)) as url:
        yield url


@pytest.fixture
def page(browser, page_origin, api_url):
    """examples/play_stream.html, pointed at the server; fails the test on any error the page throws."""
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{page_origin}/play_stream.html")
    page.fill("#server", api_url)
    yield page
    context.close()
    assert errors == [], errors


# What the page's player and status said when playback began, and when the status first said "done".
RECORD_PLAYBACK = """() => {
  const player = document.getElementById("player"), status = document.getElementById("status");
  window.heard = {};
  player.addEventListener("playing", () => {
    window.heard.playing = {at: performance.now(), status: status.textContent, buffered: player.buffered.end(0)};
  }, {once: true});
  new MutationObserver(() => {
    if (status.textContent.includes("done")) window.heard.done ??= performance.now();
  }).observe(status, {childList: true, characterData: true, subtree: true});
}"""


def test_play_stream_html_plays_the_song_while_it_is_written(page, api_url):
    page.fill("#seconds", str(PAGE_SECONDS))
    page.fill("#seed", str(PAGE_SEED))
    page.evaluate(RECORD_PLAYBACK)
    with page.expect_response("**/v1/audio/speech") as answer:
        page.click("#play")
    song = answer.value.headers["x-song-id"]
    page.wait_for_function("() => !document.getElementById('play').disabled", timeout=60_000)
    status = httpx.get(f"{api_url}/v1/songs/{song}").json()
    assert status["state"] == "done" and status["frames"] == PAGE_SECONDS * 25, status
    seconds = status["samples_sent"] / SPEECH_RATE
    length = page.evaluate("document.getElementById('player').duration")  # of the MP3 the page took in
    assert abs(length - seconds) < 0.1, (length, seconds)
    assert page.inner_text("#status") == f"seed {PAGE_SEED}: done, {length:.1f} s"

    heard = page.evaluate("window.heard")  # playback began with the song's first window, the rest still coming
    assert heard["playing"]["status"] == f"seed {PAGE_SEED}: writing...", heard
    assert heard["playing"]["at"] < heard["done"] and heard["playing"]["buffered"] < seconds - 3, heard
    page.wait_for_function("() => document.getElementById('player').currentTime > 1", timeout=10_000)
    played = page.evaluate("(() => { const p = document.getElementById('player'); return [p.paused, p.error]; })()")
    assert played == [False, None]


def test_play_stream_html_stop_cancels_the_song_on_the_server(page, api_url, engine):
    page.fill("#seconds", "60")
    page.evaluate(RECORD_PLAYBACK)
    with page.expect_response("**/v1/audio/speech") as answer:
        page.click("#play")
    song = answer.value.headers["x-song-id"]
    page.wait_for_function("() => window.heard.playing !== undefined", timeout=60_000)
    page.click("#stop")
    page.wait_for_function("() => !document.getElementById('play').disabled")
    assert page.inner_text("#status") == "stopped" and page.is_disabled("#stop")
    poll_until(lambda: httpx.get(f"{api_url}/v1/songs/{song}").json()["state"] == "cancelled", 10)
    status = httpx.get(f"{api_url}/v1/songs/{song}").json()
    assert status["frames_written"] < status["frame_budget"] == 60 * 25, status
    poll_until(lambda: not engine.talker.songs, 10)  # the engine let the song go
    assert page.evaluate("document.getElementById('player').paused")


BLANK = "must be a non-empty string, got only whitespace or invisible characters (' ')"


@pytest.mark.parametrize("field,value,status", [
    ("#seconds", "400", "Seconds, at most: 1 to 360"),  # past the model's 6 minutes: the page refuses it itself
    ("#seconds", "", "Seconds, at most: 1 to 360"),
    ("#lyrics", " ", f"Lyrics: {BLANK}"),  # the server's refusal of `input`, under the page's label
])
def test_play_stream_html_says_what_is_wrong_in_its_own_words(page, field, value, status):
    page.fill(field, value)
    page.click("#play")
    page.wait_for_function("() => !document.getElementById('play').disabled")
    assert page.inner_text("#status") == status


def test_play_stream_html_says_how_to_let_it_reach_a_server_that_does_not_answer(page, page_origin):
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        page.fill("#server", f"http://127.0.0.1:{closed.getsockname()[1]}")
        page.click("#play")
        page.wait_for_function("() => !document.getElementById('play').disabled")
    assert page.inner_text("#status") == (f"no answer from {page.input_value('#server')}: is it running, with "
                                          f"--allowed-origins {page_origin}?")


def test_play_stream_html_opened_as_a_file_says_to_serve_it(page, api_url):
    page.goto((EXAMPLES / "play_stream.html").as_uri())  # its origin is "null", which no server should allow
    page.fill("#server", api_url)
    page.click("#play")
    page.wait_for_function("() => !document.getElementById('play').disabled")
    assert page.inner_text("#status") == (f"no answer from {api_url}: open this page from a web server (see its "
                                          "first lines), not as a file")


def test_play_stream_html_sends_its_api_key(page, engine, serve_http, page_origin):
    access = Access(api_keys=("k3y",), allowed_origins=(page_origin,), hosts=HostPolicy.for_bind("127.0.0.1"))
    with serve_http(create_app(engine, access=access)) as url:
        page.fill("#server", url)
        page.fill("#lyrics", " ")  # refused, once the key is taken: no song is written
        for key, message in (("", "this server needs an API key: send Authorization: Bearer <key>"),
                             ("k3y", f"Lyrics: {BLANK}")):
            page.fill("#key", key)
            page.click("#play")
            page.wait_for_function("() => !document.getElementById('play').disabled")
            assert page.inner_text("#status") == message


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    folder: Path


EXAMPLE_KEY = "s3cret"


@pytest.fixture(scope="module")
def keyed_api_url(engine, serve_http):
    """The API as `MUSIC3_API_KEY=s3cret music3serve serve` runs it on 127.0.0.1."""
    access = Access(api_keys=(EXAMPLE_KEY,), hosts=HostPolicy.for_bind("127.0.0.1"))
    with serve_http(create_app(engine, access=access)) as url:
        yield url


@pytest.fixture(scope="module")
def example_runs(keyed_api_url, tmp_path_factory) -> dict[str, Run]:
    """curl.sh, openai_sdk.py and hosted_api.py started at once, each in a folder of its own, given the server's
    URL as their first argument and its key in MUSIC3_API_KEY (curl.sh once more with a wrong key). curl.sh needs
    curl, jq and xxd, and is left out without them."""
    commands = {name: [sys.executable, str(EXAMPLES / name), keyed_api_url]
                for name in ("openai_sdk.py", "hosted_api.py")}
    if all(shutil.which(tool) for tool in ("curl", "jq", "xxd")):
        commands["curl.sh"] = commands["curl.sh wrong key"] = ["sh", str(EXAMPLES / "curl.sh"), keyed_api_url]
    started = {}
    for name, command in commands.items():
        folder = tmp_path_factory.mktemp(name.replace(".", "_").replace(" ", "_"))
        key = "wrong" if name.endswith("wrong key") else EXAMPLE_KEY
        started[name] = folder, subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                 text=True, env={**os.environ, "MUSIC3_API_KEY": key})
    runs = {}
    for name, (folder, process) in started.items():
        try:
            stdout, stderr = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        runs[name] = Run(process.returncode, stdout, stderr, folder)
    return runs


def ran(runs: dict[str, Run], name: str, ok: bool = True) -> Run:
    if name not in runs:  # as the browser: a skip, or a failure under CI (where `make test` installs them)
        why = f"{name} needs curl, jq and xxd (apt-get install curl jq xxd)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    run = runs[name]
    assert (run.returncode == 0) == ok, (run.stdout, run.stderr)
    return run


def test_openai_sdk_py_writes_one_song_whole_streamed_and_as_events(example_runs):
    run = ran(example_runs, "openai_sdk.py")
    wav, mp3, events = run.stdout.splitlines()
    assert wav == "song.wav, seed 7" and mp3 == "song.mp3"
    head, usage = events.split(", usage ")
    usage = ast.literal_eval(usage)
    assert head == "song.pcm (s16le, stereo, 32 kHz)" and usage["output_tokens"] == SCRIPT_FRAMES
    assert usage["total_tokens"] == usage["input_tokens"] + SCRIPT_FRAMES and usage["input_tokens"] > 0
    whole, rate = soundfile.read(run.folder / "song.wav", dtype="int16")
    assert rate == SPEECH_RATE and whole.shape == (expected_samples(SCRIPT_FRAMES, rate), 2)
    assert_song_audio((run.folder / "song.mp3").read_bytes(), "mp3", rate, SCRIPT_FRAMES)
    pcm = np.frombuffer((run.folder / "song.pcm").read_bytes(), "<i2").reshape(-1, 2)
    assert pcm.shape == whole.shape and np.abs(pcm.astype(np.int32) - whole).max() <= BATCH_LSB  # the same song


def test_hosted_api_py_writes_the_song_whole_and_streamed_with_its_extra_info(example_runs):
    run = ran(example_runs, "hosted_api.py")
    lines = run.stdout.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["hosted.mp3", "hosted_stream.mp3"]
    for line in lines:
        name, info = line.split(" ", 1)
        audio = (run.folder / name).read_bytes()
        assert_song_audio(audio, "mp3", 44100, SCRIPT_FRAMES)
        assert ast.literal_eval(info) == {
            "music_duration": round(1000 * expected_samples(SCRIPT_FRAMES, 44100) / 44100),
            "music_sample_rate": 44100, "music_channel": 2, "bitrate": 256000, "music_size": len(audio)}


def test_curl_sh_writes_every_endpoints_song_and_lists_the_models(example_runs):
    run = ran(example_runs, "curl.sh")
    headers, models = run.stdout.strip().rsplit("\n", 1)
    assert headers.startswith("HTTP/1.1 200 OK") and "x-seed: 7" in headers and "content-type: audio/wav" in headers
    assert [model["id"] for model in json.loads(models)["data"]] == ["MiniMax-Music3", "MiniMaxAI/MiniMax-Music3"]
    song, rate = soundfile.read(run.folder / "song.wav", dtype="int16")
    assert rate == 44100 and song.shape == (expected_samples(SCRIPT_FRAMES, rate), 2) and np.abs(song).max() > 0
    assert_song_audio((run.folder / "speech.wav").read_bytes(), "wav", SPEECH_RATE, SCRIPT_FRAMES)
    assert_song_audio((run.folder / "speech.ogg").read_bytes(), "opus", 48000, SCRIPT_FRAMES)
    assert_song_audio((run.folder / "hosted.mp3").read_bytes(), "mp3", 44100, SCRIPT_FRAMES)


def test_curl_sh_stops_at_an_http_error_with_its_body_shown(example_runs):
    run = ran(example_runs, "curl.sh wrong key", ok=False)
    assert json.loads(run.stderr) == {"error": "the API key is not valid"}  # /v1/songs' error body
    assert list(run.folder.iterdir()) == []  # no error body left behind as a song


def test_the_readmes_openai_sdk_example_runs_as_written(api_url, tmp_path):
    """README.md's OpenAI SDK example, pasted as it is with the server's address: a 30 s song at 32 kHz (it named
    variables it never set)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    code = next(block for block in blocks if "from openai import OpenAI" in block)
    assert code.count("http://localhost:8000") == 1
    subprocess.run([sys.executable, "-c", code.replace("http://localhost:8000", api_url)], cwd=tmp_path, check=True,
                   timeout=300)
    audio, rate = soundfile.read(tmp_path / "song.wav", dtype="int16")
    assert rate == SPEECH_RATE and audio.shape == (expected_samples(750, rate), 2)
