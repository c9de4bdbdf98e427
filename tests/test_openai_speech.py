"""POST /v1/audio/speech, GET /v1/models and GET /v1/models/{model} through the OpenAI Python SDK against a real
server on the tiny checkpoint: the official contract (32 kHz WAV by default, seed 0), every format decoded back by
PyAV, streamed bytes and SSE events, the SDK's typed errors, and the same song as POST /v1/songs bit for bit."""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
av = pytest.importorskip("av")

from music3serve import contract
from music3serve.serving.audio_io import resample, to_pcm16
from music3serve.serving.engine import Engine
from music3serve.serving.events import AudioChunk, SongRequest
from decoding import assert_song_audio, decode  # tests/ is on the import path (no package)

LYRICS, CAPTION = "[verse]\nla la", "synth pop, 120 bpm"
FRAMES = 50  # one window: 2 s
LONG_FRAMES = 250  # two windows
EXTRA = {"seed": 7, "max_new_tokens": FRAMES, "steps": 2}


@pytest.fixture(scope="module")
def sdk(base_url: str):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def song(engine: Engine) -> np.ndarray:
    """The song of EXTRA's seed as the engine's own events carry it (float32, 44.1 kHz)."""
    import asyncio

    async def collect() -> np.ndarray:
        request = SongRequest(CAPTION, LYRICS, FRAMES / contract.FRAME_RATE, EXTRA["seed"], EXTRA["steps"])
        return np.concatenate([e.pcm async for e in engine.submit(request) if isinstance(e, AudioChunk)], axis=-1)

    return asyncio.run(asyncio.wait_for(collect(), 120))


def speak(sdk, **fields):
    extra = {**EXTRA, **fields.pop("extra_body", {})}
    return sdk.audio.speech.create(model="MiniMax-Music3", voice="default", input=LYRICS, instructions=CAPTION,
                                   extra_body=extra, **fields)


def wav_samples(body: bytes) -> tuple[int, np.ndarray]:
    with wave.open(io.BytesIO(body)) as file:
        return file.getframerate(), np.frombuffer(file.readframes(file.getnframes()), "<i2").reshape(-1, 2)


def test_the_official_default_is_32k_wav_equal_to_our_resampler(sdk, song):
    response = speak(sdk)
    assert response.response.headers["content-type"] == "audio/wav"
    assert response.response.headers["x-seed"] == "7"
    rate, pcm = wav_samples(response.content)
    assert rate == 32000
    assert np.abs(pcm.astype(np.int32) - to_pcm16(resample(song, 44100, 32000)).astype(np.int32)).max() <= 1


def test_44k_wav_equals_post_v1_songs_bit_for_bit(sdk, client):
    speech = speak(sdk, extra_body={"sample_rate": 44100}).content
    songs = client.post("/v1/songs", json={"caption": CAPTION, "lyrics": LYRICS, "duration": FRAMES / 25,
                                           "seed": 7, "steps": 2, "stream": False}).content
    assert speech == songs and wav_samples(speech)[0] == 44100


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("format", ["wav", "mp3", "flac", "opus", "aac", "pcm"])
def test_every_format_decodes_to_the_song(sdk, song, format, stream):
    with sdk.audio.speech.with_streaming_response.create(
        model="MiniMax-Music3", voice="default", input=LYRICS, instructions=CAPTION, response_format=format,
        extra_body={**EXTRA, "sample_rate": 44100, "stream": stream},
    ) as response:
        body = b"".join(response.iter_bytes())
        headers = response.headers
    rate = 48000 if format == "opus" else 44100  # libopus encodes at 48 kHz
    assert headers["x-sample-rate"] == str(rate)
    decoded = assert_song_audio(body, format, rate, FRAMES)
    if format in ("flac", "pcm", "wav"):  # lossless: the same 16-bit samples
        want = to_pcm16(song).T.astype(np.float32) / 32767.0
        assert np.abs(decoded - want).max() <= 1.5 / 32767


@pytest.mark.parametrize(("format", "rate"), [("mp3", 32000), ("opus", 48000)])
def test_a_streamed_song_decodes_while_it_is_still_being_written(sdk, client, format, rate):
    fields = {**EXTRA, "max_new_tokens": LONG_FRAMES, "stream": True}
    with sdk.audio.speech.with_streaming_response.create(
        model="MiniMax-Music3", voice="default", input=LYRICS, instructions=CAPTION, response_format=format,
        extra_body=fields,
    ) as response:
        song_id, pieces, first, decoded = response.headers["x-song-id"], response.iter_bytes(), b"", 0
        while decoded < 2 * rate:  # of the first window's 5 s
            first += next(pieces)
            try:
                got_rate, channels, pcm = decode(first)
            except av.error.FFmpegError:  # only the container's header pages so far
                continue
            decoded = pcm.shape[-1]
        state = client.get(f"/v1/songs/{song_id}").json()["state"]
        rest = b"".join(pieces)
    assert state == "running" and (got_rate, channels) == (rate, 2)
    assert_song_audio(first + rest, format, rate, LONG_FRAMES)


def test_sse_events_carry_the_audio_and_the_usage(sdk, client):
    with sdk.audio.speech.with_streaming_response.create(
        model="MiniMax-Music3", voice="default", input=LYRICS, instructions=CAPTION, response_format="pcm",
        stream_format="sse", extra_body=EXTRA,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        prompt_tokens = int(response.headers["x-prompt-tokens"])
        lines = list(response.iter_lines())
    events = [(lines[i].removeprefix("event: "), json.loads(lines[i + 1].removeprefix("data: ")))
              for i, line in enumerate(lines) if line.startswith("event: ")]
    *deltas, (name, done) = events
    assert name == "speech.audio.done" and {n for n, _ in deltas} == {"speech.audio.delta"}
    audio = b"".join(base64.b64decode(event["audio"]) for _, event in deltas)
    whole = speak(sdk, response_format="pcm").content
    assert audio == whole
    assert done["usage"] == {"input_tokens": prompt_tokens, "output_tokens": FRAMES,
                             "total_tokens": prompt_tokens + FRAMES}
    assert done["seed"] == 7 and done["seconds"] == len(audio) / 4 / 32000 and done["first_audio_s"] > 0


def test_a_seed_past_2_63_is_its_own_song(sdk):
    """Seeds take all 64 bits: 2**63 + 7 is another song than 7, and the same song each time."""
    high = speak(sdk, response_format="pcm", extra_body={"seed": 2**63 + 7}).content
    assert high == speak(sdk, response_format="pcm", extra_body={"seed": 2**63 + 7}).content
    assert high != speak(sdk, response_format="pcm").content


def test_models_lists_the_served_names(sdk):
    assert [model.id for model in sdk.models.list()] == list(contract.SERVED_MODEL_NAMES)


def test_the_sdk_retrieves_each_served_model_and_no_other(sdk, client):
    listed = client.get("/v1/models").json()["data"]
    assert [sdk.models.retrieve(card["id"]).model_dump() for card in listed] == listed  # a name with a slash too
    with pytest.raises(openai.NotFoundError) as error:
        sdk.models.retrieve("tts-1")
    assert error.value.body["param"] == "model" and error.value.body["code"] == "model_not_found"
    assert error.value.body["message"] == "model 'tts-1' is not served here; it serves " + ", ".join(
        contract.SERVED_MODEL_NAMES)


def test_the_sdk_raises_its_typed_errors(sdk):
    with pytest.raises(openai.BadRequestError) as error:
        speak(sdk, speed=1.5)
    assert error.value.body["param"] == "speed" and "speed" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        speak(sdk, extra_body={"temperature": 0.7})
    assert error.value.body["param"] == "temperature" and error.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as error:
        sdk.audio.speech.create(model="tts-1", voice="default", input=LYRICS, instructions=CAPTION)
    assert error.value.body["param"] == "model" and error.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as error:  # a call written for OpenAI's voices: the model comes first
        sdk.audio.speech.create(model="tts-1", voice="alloy", input=LYRICS, speed=1.5)
    assert error.value.body["param"] == "model" and error.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as error:  # past the prompt's tokens: this endpoint's field names
        sdk.audio.speech.create(model="MiniMax-Music3", voice="default", input="[verse]\n" + "q7 " * 6000,
                                instructions=CAPTION, extra_body=EXTRA)
    assert error.value.body["message"].startswith("the prompt (instructions + input) is ")


def test_a_song_that_does_not_fit_the_unread_audio_gets_429_saying_a_lower_cap_reserves_less(sdk, engine):
    """Without max_new_tokens a song reserves its 9000 frames' audio; the 429 says so in one unit."""
    limit, held = engine.max_unread_bytes, 2**30  # 1 GiB a caller holds, read, of 1.1 GiB
    engine.max_unread_bytes = int(1.1 * 2**30)
    engine.hold_read_audio(held)
    try:
        with pytest.raises(openai.RateLimitError) as error:
            sdk.audio.speech.create(model="MiniMax-Music3", voice="default", input=LYRICS, instructions=CAPTION)
    finally:
        engine.hold_read_audio(-held)
        engine.max_unread_bytes = limit
    message = error.value.body["message"]
    assert "this song's 121.3 MiB would pass the engine's 1.10 GiB" in message, message
    assert message.endswith("by its max_new_tokens (9000 frames, 121.3 MiB, by default): a lower one reserves less")


SPEECH = {"model": "MiniMax-Music3", "input": LYRICS, "instructions": CAPTION, **EXTRA}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": 3}, "model"), ({"input": None}, "input"), ({"input": " "}, "input"),
        ({"instructions": ""}, "instructions"), ({"voice": "alloy"}, "voice"), ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"), ({"seed": "7"}, "seed"), ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 9001}, "max_new_tokens"), ({"response_format": "ogg"}, "response_format"),
        ({"sample_rate": 48000}, "sample_rate"), ({"sample_rate": 32000.0}, "sample_rate"),
        ({"stream": "yes"}, "stream"), ({"stream_format": "chunks"}, "stream_format"), ({"speed": 2}, "speed"),
        ({"steps": 0}, "steps"), ({"top_p": 0.9}, "top_p"), ({"top_k": 5}, "top_k"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"), ({"ref_audio": "a.wav"}, "ref_audio"),
        ({"ref_text": "hi"}, "ref_text"), ({"language": "en"}, "language"), ({"task_type": "tts"}, "task_type"),
        ({"nonsense": 1}, "nonsense"),
    ],
)
def test_every_invalid_field_is_a_400_naming_it(client, change, field):
    response = client.post("/v1/audio/speech", json={**SPEECH, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] in (field, None)  # None: the body as a whole (an unknown key)


def test_the_engines_refusals_name_the_fields_as_this_endpoint_calls_them(client):
    response = client.post("/v1/audio/speech", json={**SPEECH, "instructions": "\u200b"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "instructions"
    assert response.json()["error"]["message"].startswith("instructions must be a non-empty string")


def test_a_songs_first_window_goes_to_the_encoder_with_a_short_first_slice(sdk, monkeypatch):
    from music3serve.serving import song_service
    from music3serve.serving.song_feed import FEED_SAMPLES, FIRST_FEED_SAMPLES

    fed: list[list[int]] = []  # per window: its slices' lengths
    slices_of = song_service.window_slices

    def recorded(pcm, last, first=False):
        slices = slices_of(pcm, last, first)
        fed.append([piece.shape[-1] for piece, _ in slices])
        return slices

    monkeypatch.setattr(song_service, "window_slices", recorded)
    body = speak(sdk, response_format="mp3", extra_body={"max_new_tokens": LONG_FRAMES, "stream": True}).content
    assert body and len(fed) == 2  # two windows
    assert fed[0][0] == FIRST_FEED_SAMPLES and fed[0][1] == FEED_SAMPLES and fed[1][0] == FEED_SAMPLES
