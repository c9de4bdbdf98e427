"""The web studio at `/` in headless Chromium (Debian's `chromium`, driven by Playwright) against a real server (uvicorn
over an Engine on the tiny checkpoint): a song is written from the keyboard and plays before it is done, Stop cancels
it on the server, downloads decode, errors land beside their fields, takes survive a reload, and the page fits a
phone in dark mode. Without the browser the browser tests skip, except under CI (CI=true), where they fail
(tests/conftest.py's `browser`)."""

from __future__ import annotations

import io
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
soundfile = pytest.importorskip("soundfile")

from music3serve.prompt import normalize_lyrics
from music3serve.serving.engine import Engine
from polling import poll_until  # tests/ is on the import path (no package)

# Where the screenshots go: MUSIC3_STUDIO_SHOTS=docs writes the ones committed under docs/.
SHOTS = os.environ.get("MUSIC3_STUDIO_SHOTS")
CAPTION = "Dreamy synth-pop, 110 BPM, A minor. Breathy female vocals. Analog pads, gated drums."
LYRICS = "[verse]\nNeon skies over empty streets\n[chorus]\nHold on"
SEED, STEPS = "4242", "2"
DURATION = 12  # seconds: 300 frames, the first window's audio leaves at frame 201 and the last at 300
# 16-bit steps between two runs of one song in different batches (tests/test_engine.py's 1.5e-4, and rounding).
BATCH_LSB = 6


@pytest.fixture(scope="module")
def engine(tiny_dir: Path):
    with Engine.from_pretrained(tiny_dir, device="cpu") as engine:
        yield engine


@pytest.fixture
def page(browser, base_url):
    """A fresh browser profile (its own IndexedDB and localStorage) on the studio."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    errors: list[str] = []  # uncaught exceptions, and console errors such as a Content-Security-Policy refusal
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: message.type == "error" and not message.text.startswith(
        "Failed to load resource") and errors.append(message.text))  # a refused request (a 400, 429) is logged
    page.goto(base_url + "/")
    page.wait_for_function("() => window.studio && window.studio.state === 'idle'")
    yield page
    context.close()
    assert errors == [], errors


def shot(page, name: str, tmp_path: Path, full_page: bool = False) -> Path:
    path = (Path(SHOTS) if SHOTS else tmp_path) / name
    page.screenshot(path=str(path), full_page=full_page)
    return path


def studio(page) -> dict:
    return page.evaluate("JSON.parse(JSON.stringify(window.studio))")


def pcm_of(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").reshape(-1, 2)


# --- without the browser ---------------------------------------------------------------------------------
def test_page_and_its_files_are_served_from_the_package(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert client.head("/").status_code == 200
    files = set(re.findall(r'(?:src|href)="(/studio/[^"]+)"', page.text))
    for name in list(files):  # the modules' own imports too
        files |= {f"/studio/{m}" for m in re.findall(r'from "\./([^"]+)"', client.get(name).text)}
    assert {"/studio/studio.js", "/studio/studio.css", "/studio/player.js", "/studio/history.js"} <= files
    for name in files:
        response = client.get(name)
        assert response.status_code == 200, name
        assert not re.search(r"https?://", response.text), f"{name} reaches outside the server"
    assert client.get("/studio/nothing.js").status_code == 404


def test_progress_of_a_running_song(client):
    """GET /v1/songs/{id} counts frames written and windows rendered while the song runs, and its timings at the end."""
    seen = []
    with client.stream("POST", "/v1/songs", json={"caption": CAPTION, "lyrics": LYRICS, "duration": 9,
                                                  "seed": 1, "steps": 2, "format": "pcm"}) as response:
        song = response.headers["X-Song-Id"]
        for _ in response.iter_bytes():
            seen.append(client.get(f"/v1/songs/{song}").json())
    status = client.get(f"/v1/songs/{song}").json()
    assert seen[0]["state"] == "running" and seen[0]["frames_written"] >= 200 and seen[0]["windows_rendered"] >= 1
    assert [s["frames_written"] for s in seen] == sorted(s["frames_written"] for s in seen)
    assert status["frames_written"] == status["frames"] == 225 and status["windows_rendered"] == 2
    assert 0 < status["timings"]["first_audio_s"] < status["timings"]["total_s"]


# --- in the browser --------------------------------------------------------------------------------------
def test_a_song_written_from_the_keyboard_plays_while_it_is_written(page, client, base_url, tmp_path):
    page.focus("#caption")
    page.keyboard.type(CAPTION)
    order = [page.evaluate("document.activeElement.id")]
    for _ in range(8):  # the form's focus order
        page.keyboard.press("Tab")
        order.append(page.evaluate("document.activeElement.id || document.activeElement.textContent.trim()"))
    assert order == ["caption", "lyrics", "a song", "an instrumental", "duration", "seed", "seed-random",
                     "More settings", "generate"], order
    page.focus("#lyrics")
    page.keyboard.type(LYRICS)
    page.fill("#duration", str(DURATION))
    page.click("summary")
    page.fill("#steps", STEPS)
    page.focus("#seed")
    page.keyboard.type(SEED)
    page.keyboard.press("Control+Enter")  # generates from any field

    page.wait_for_function("() => window.studio.times.playing !== undefined", timeout=60_000)
    song = studio(page)["id"]
    status = client.get(f"/v1/songs/{song}").json()  # the page plays while the server is still writing the song
    assert status["state"] == "running" and 200 <= status["frames_written"] < status["frame_budget"], status
    page.wait_for_function("() => window.studio.state === 'done'", timeout=60_000)
    measured, status = studio(page), client.get(f"/v1/songs/{song}").json()
    times, server = measured["times"], status["timings"]
    # The page's clock starts before its POST, the engine's when it takes the song: a little earlier and longer.
    assert -50 <= times["firstAudio"] - 1000 * server["first_audio_s"] < 1500, (times, server)
    assert times["firstAudio"] <= times["playing"] < times["end"]
    progress = page.inner_text("#progress")
    assert re.search(rf"^Done · frames 300 / 300 · windows {status['windows_rendered']} · first audio", progress)

    page.reload()  # the take is kept in the browser
    take = page.locator("#takes li").first
    take.wait_for()
    assert f"seed {SEED}" in take.inner_text()
    with page.expect_download() as download:
        take.locator("[data-act=download]").click()
    wav, rate = soundfile.read(download.value.path(), dtype="int16")
    assert rate == 44100 and wav.shape == (status["samples_sent"], 2) and np.abs(wav).max() > 0

    # The same inputs and seed again, each reused in one click, are the same song (to batch rounding: a reference
    # from the server runs beside it).
    take.locator("[data-act=inputs]").click()
    assert (page.input_value("#caption"), page.input_value("#seed")) == (CAPTION, "")
    take.locator("[data-act=seed]").click()
    assert page.input_value("#seed") == SEED
    request = {"caption": CAPTION, "lyrics": LYRICS, "duration": DURATION, "seed": int(SEED), "steps": int(STEPS),
               "format": "pcm", "stream": False}
    reference = {}
    beside = threading.Thread(target=lambda: reference.update(song=client.post("/v1/songs", json=request).content))
    page.keyboard.press("Enter")  # Enter in a field submits the form
    beside.start()
    page.wait_for_function("() => window.studio.times.playing !== undefined", timeout=60_000)
    if SHOTS:
        page.wait_for_timeout(1500)  # for the docs: a second of the song played
    shot(page, "studio.png", tmp_path)  # mid-generation, the first take below
    page.wait_for_function("() => window.studio.state === 'done'", timeout=60_000)
    beside.join(60)
    assert page.locator("#takes li").count() == 2
    with page.expect_download() as download:  # the newest take: the second
        take.locator("[data-act=download]").click()
    second = soundfile.read(download.value.path(), dtype="int16")[0]
    for other in (pcm_of(reference["song"]), second):
        assert other.shape == wav.shape and np.abs(other.astype(np.int32) - wav).max() <= BATCH_LSB

    for format in ("flac", "mp3"):  # encoded by the server, or a clear message where it has no such encoder
        downloads = []
        page.once("download", lambda download: downloads.append(download))
        take.locator("[data-act=format]").select_option(format)
        take.locator("[data-act=download]").click()
        page.wait_for_function("() => !/writing/.test(document.querySelector('#takes li .take-status').textContent)",
                               timeout=60_000)
        refused = client.post("/v1/songs", json={**request, "format": format, "duration": 0.04}).status_code == 400
        message = take.locator(".take-status").inner_text()
        if refused:
            assert f"This server does not write {format.upper()} files" in message, message
            continue
        audio = downloads[0].path().read_bytes()
        decoded = decode(audio, format)
        assert decoded.shape[1] == 2 and abs(len(decoded) - len(wav)) <= (0 if format == "flac" else 4096)

    page.check("#takes li:nth-child(1) [data-act=ab]")  # A/B of the two takes
    page.check("#takes li:nth-child(2) [data-act=ab]")
    page.wait_for_function("() => document.getElementById('ab-note').textContent !== ''")
    assert page.inner_text("#ab-note") == "Same lyrics."
    page.click("#ab-play")
    page.wait_for_function("() => document.getElementById('ab-switch').disabled === false")
    page.click("#ab-switch")
    assert page.inner_text("#ab-switch") == "Switch to A"


def decode(data: bytes, format: str) -> np.ndarray:
    if format == "flac":
        return soundfile.read(io.BytesIO(data), dtype="int16")[0]
    av = pytest.importorskip("av")
    with av.open(io.BytesIO(data)) as container:
        frames = [frame.to_ndarray() for frame in container.decode(audio=0)]
    planes = np.concatenate(frames, axis=-1)
    return planes.T if planes.shape[0] == 2 else planes.reshape(-1, 2)


def test_stop_cancels_the_song_on_the_server(page, client, engine):
    page.fill("#caption", CAPTION)
    page.fill("#lyrics", LYRICS)
    page.fill("#duration", "120")
    page.click("summary")
    page.fill("#steps", STEPS)
    page.click("#generate")
    page.wait_for_function("() => window.studio.status && window.studio.status.frames_written > 0", timeout=60_000)
    song = studio(page)["id"]
    page.keyboard.press("Escape")  # Stop
    page.wait_for_function("() => window.studio.state === 'stopped'", timeout=30_000)
    status = client.get(f"/v1/songs/{song}").json()
    assert status["state"] == "cancelled" and status["frames_written"] < status["frame_budget"]
    poll_until(lambda: not engine.talker.songs, 10)  # the engine let the song go
    assert "stopped" in page.locator("#takes li").first.inner_text()


def test_a_song_waiting_for_the_talkers_rows_shows_queued(page, client, engine, monkeypatch):
    """The page said "Writing" while the song waited in the talker's queue (the server said "running" then too)."""
    monkeypatch.setattr(engine.talker.slots, "pairs", 0)  # no song gets rows: each waits in the talker's queue
    page.fill("#caption", CAPTION)
    page.fill("#lyrics", LYRICS)
    page.click("#generate")
    page.wait_for_function("() => document.getElementById('progress').textContent.startsWith('Queued')",
                           timeout=30_000)
    assert client.get(f"/v1/songs/{studio(page)['id']}").json()["state"] == "queued"
    page.keyboard.press("Escape")  # Stop
    page.wait_for_function("() => window.studio.state === 'stopped'", timeout=30_000)
    poll_until(lambda: not engine.talker.songs, 10)


def test_errors_show_beside_their_fields(page, engine):
    page.fill("#caption", CAPTION)
    page.fill("#lyrics", LYRICS)
    page.fill("#duration", "999")
    page.click("#generate")
    error = page.locator("#duration-error")
    error.wait_for()
    assert "duration" in error.inner_text() and "360" in error.inner_text()
    assert page.get_attribute("#duration", "aria-invalid") == "true"
    assert page.evaluate("document.activeElement.id") == "duration"
    page.fill("#duration", "10")
    page.fill("#caption", "   ")  # blank: the engine refuses it
    page.click("#generate")
    page.locator("#caption-error").wait_for()
    assert "caption must be a non-empty string" in page.inner_text("#caption-error")
    assert page.is_hidden("#duration-error")
    page.fill("#caption", CAPTION)
    page.fill("#seed", "12x")
    page.click("#generate")
    assert "seed must be a whole number" in page.inner_text("#seed-error")
    page.fill("#seed", str(2**64))  # one past the server's range: refused in the page, never sent
    page.click("#generate")
    assert "0 to 2^64 - 1" in page.inner_text("#seed-error")

    page.fill("#seed", "")
    page.click("summary")
    page.fill("#api-key", "k3y")  # kept in the browser, sent with every request
    page.reload()
    page.wait_for_function("() => window.studio && window.studio.state === 'idle'")
    page.fill("#caption", CAPTION)
    page.fill("#lyrics", LYRICS)
    engine.max_songs, held = 0, engine.max_songs  # the server is full: 429
    try:
        with page.expect_request("**/v1/songs") as posted:
            page.click("#generate")
        page.locator("#banner").wait_for()
    finally:
        engine.max_songs = held
    assert posted.value.headers["authorization"] == "Bearer k3y" and page.input_value("#api-key") == "k3y"
    assert page.inner_text("#banner").startswith("The server is busy: the engine holds 0 songs")
    assert page.evaluate("window.studio.state") == "idle"


def luminance(color: str) -> float:
    channels = [int(c) / 255 for c in re.findall(r"\d+", color)[:3]]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a: str, b: str) -> float:
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


@pytest.mark.parametrize("scheme", ["dark", "light"])
def test_fits_a_phone_and_reads_in_both_schemes(browser, base_url, scheme, tmp_path):
    context = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True,
                                  has_touch=True, color_scheme=scheme)
    page = context.new_page()
    page.goto(base_url + "/")
    page.wait_for_function("() => window.studio && window.studio.state === 'idle'")
    page.click("[data-example=song]")
    page.fill("#lyrics", "[verse] neon skies\n[chorus]\nhold on")  # text after a tag: dropped by the prompt rules
    page.dispatch_event("#lyrics", "input")
    assert "line 1: “neon skies” after [verse]" in page.inner_text("#lyrics-warning")
    page.fill("#duration", "999")
    page.click("#generate")
    page.locator("#duration-error").wait_for()
    page.evaluate("window.scrollTo(0, 0)")
    shot(page, f"studio-phone-{scheme}.png", tmp_path, full_page=True)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the screen
    colors = page.evaluate("""() => Object.fromEntries(
        ['body', '.card', 'label', '.hint', '#duration-error', '#generate', '#lyrics-warning', 'textarea'].map(
            s => [s, [getComputedStyle(document.querySelector(s)).color,
                      getComputedStyle(document.querySelector(s)).backgroundColor]]))""")
    card = colors[".card"][1]
    assert (luminance(colors["body"][1]) < 0.05) == (scheme == "dark")
    for selector in ("label", ".hint", "#duration-error"):
        assert contrast(colors[selector][0], card) >= 4.5, (selector, colors[selector], card)
    for selector in ("#generate", "#lyrics-warning", "textarea"):  # text on its own background
        assert contrast(*colors[selector]) >= 4.5, (selector, colors[selector])
    page.click("#lyrics-warning button")  # the fix: the text moves to a line of its own
    assert page.input_value("#lyrics").startswith("[verse]\nneon skies\n") and page.is_hidden("#lyrics-warning")
    context.close()


def test_the_lyrics_warning_follows_the_prompt_rules(page):
    """The page warns of exactly the lines whose words the checkpoint's lyrics rules (music3serve/prompt.py) drop."""
    lines = ["[verse] neon skies", "  [intro][verse]\tla la", "[verse]", "[chorus]  ", "la [la] la", "[unclosed text",
             "\t[x]\t y", "[Bridge] [outro] ^ end", "plain words"]
    warned = page.evaluate("""async (lines) => {
        const form = await import('/studio/form.js');
        return lines.map((line) => form.droppedText(line).length > 0); }""", lines)
    dropped = [any(word.lower() not in normalize_lyrics(line).lower() for word in line.split()) for line in lines]
    assert warned == dropped and any(dropped) and not all(dropped), list(zip(lines, warned, dropped))


def test_the_clock_reads_a_take_as_its_card_does(page):
    """m:ss to the nearest second, as a take's card rounds its length: a 5.96 s take is 0:06 long, not 0:05."""
    read = page.evaluate("""async (seconds) => {
        const player = await import('/studio/player.js');
        return seconds.map((s) => player.clock(s)); }""", [0, 5.4, 5.96, 59.6, 61, 3600])
    assert read == ["0:00", "0:05", "0:06", "1:00", "1:01", "60:00"]
