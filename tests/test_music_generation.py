"""POST /v1/music_generation (MiniMax's hosted shape) and the formats of POST /v1/songs, against a real server on the
tiny checkpoint: the hex envelope and its extra_info, the hex event stream, each hosted rate and format decoded
back by PyAV, the refusals of what the open weights cannot do, and mp3/opus/aac/flac on /v1/songs."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("av")

from decoding import assert_song_audio, decode, expected_samples  # tests/ is on the import path (no package)

FRAMES = 50
MUSIC = {"model": "MiniMax-Music3", "prompt": "synth pop, 120 bpm", "lyrics": "[verse]\nla la", "seed": 7,
         "max_new_tokens": FRAMES, "steps": 2}
SONG = {"caption": MUSIC["prompt"], "lyrics": MUSIC["lyrics"], "seed": 7, "steps": 2, "duration": FRAMES / 25}


@pytest.mark.parametrize(("format", "rate"), [("mp3", 44100), ("mp3", 16000), ("wav", 24000), ("pcm", 32000)])
def test_the_hex_envelope_holds_the_song_and_its_extra_info(client, format, rate):
    setting = {"format": format, "sample_rate": rate, "bitrate": 128000}
    response = client.post("/v1/music_generation", json={**MUSIC, "audio_setting": setting})
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    body = response.json()
    audio = bytes.fromhex(body["data"]["audio"])
    assert body["data"]["status"] == 2 and body["base_resp"] == {"status_code": 0, "status_msg": "success"}
    assert_song_audio(audio, format, rate, FRAMES)
    assert body["extra_info"] == {"music_duration": round(1000 * expected_samples(FRAMES, rate) / rate),
                                  "music_sample_rate": rate, "music_channel": 2, "bitrate": 128000,
                                  "music_size": len(audio)}
    assert body["trace_id"] == response.headers["x-song-id"]


def test_stream_sends_hex_chunks_then_the_extra_info(client):
    with client.stream("POST", "/v1/music_generation", json={**MUSIC, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data:")]
    *chunks, last = events
    audio = b"".join(bytes.fromhex(event["data"]["audio"]) for event in chunks)
    assert {event["data"]["status"] for event in chunks} == {1} and last["data"] == {"audio": "", "status": 2}
    assert last["extra_info"]["music_size"] == len(audio) and last["base_resp"]["status_code"] == 0
    assert_song_audio(audio, "mp3", 44100, FRAMES)


def test_an_instrumental_needs_no_lyrics(client):
    body = {key: value for key, value in MUSIC.items() if key != "lyrics"}
    response = client.post("/v1/music_generation", json={**body, "is_instrumental": True})
    assert response.status_code == 200 and response.json()["base_resp"]["status_code"] == 0


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"output_format": "url"}, "storage"), ({"lyrics_optimizer": True}, "another model"),
        ({"audio_url": "https://example.com/a.mp3"}, "cover songs"), ({"audio_base64": "AAAA"}, "cover songs"),
        ({"refer_voice": "v1"}, "reference audio"), ({"aigc_watermark": True}, "watermark"),
        ({"is_instrumental": True}, "not both"), ({"lyrics": None}, "required unless is_instrumental"),
        ({"prompt": None}, "prompt"), ({"prompt": " "}, "prompt"), ({"audio_setting": {"sample_rate": 48000}},
                                                                    "sample_rate"),
        ({"audio_setting": {"bitrate": 100}}, "bitrate"), ({"audio_setting": {"format": "flac"}}, "format"),
        ({"seed": -1}, "seed"), ({"max_new_tokens": 9001}, "max_new_tokens"), ({"stream": 1}, "stream"),
        ({"lyrics": "[verse]\n" + "q7 " * 6000}, "the prompt (prompt + lyrics) is "),
    ],
)
def test_refusals_come_in_the_envelope_naming_the_field(client, change, needle):
    response = client.post("/v1/music_generation", json={**MUSIC, **change})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["base_resp"]["status_code"] == 2013 and needle in body["base_resp"]["status_msg"]
    assert "Value error" not in body["base_resp"]["status_msg"]  # our words, not pydantic's prefix
    assert body["data"] is None


@pytest.mark.parametrize("other", [{}, {"lyrics_optimizer": True, "prompt": 7}], ids=["alone", "before other faults"])
def test_an_unknown_model_is_a_404_in_the_envelope(client, other):
    response = client.post("/v1/music_generation", json={**MUSIC, "model": "music-2.6", **other})
    assert response.status_code == 404 and "MiniMax-Music3" in response.json()["base_resp"]["status_msg"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("format", ["mp3", "opus", "aac", "flac"])
def test_post_v1_songs_takes_every_format(client, format, stream):
    response = client.post("/v1/songs", json={**SONG, "format": format, "sample_rate": 32000, "stream": stream})
    assert response.status_code == 200
    rate = 48000 if format == "opus" else 32000
    assert response.headers["x-sample-rate"] == str(rate)
    assert_song_audio(response.content, format, rate, FRAMES)
    status = client.get(f"/v1/songs/{response.headers['x-song-id']}").json()
    assert status["format"] == format and status["sample_rate"] == rate and status["state"] == "done"
    assert status["samples_sent"] == expected_samples(FRAMES, rate)  # the samples the bytes sent encode


def test_flac_decodes_to_the_wav_samples_bit_for_bit(client):
    wav = client.post("/v1/songs", json={**SONG, "stream": False}).content
    flac = client.post("/v1/songs", json={**SONG, "stream": False, "format": "flac"}).content
    assert (decode(flac)[2] == decode(wav)[2]).all()
