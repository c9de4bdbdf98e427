"""A song through the MiniMax hosted music API's shape (POST /v1/music_generation), whole and streamed, with httpx.
Code written for the hosted API needs only the base URL changed (and the model name: start the server with
`--served-model-name MiniMax-Music3 --served-model-name MiniMaxAI/MiniMax-Music3 --served-model-name music-2.6`
to take the hosted one as well: the names given replace the defaults). Needs httpx (`pip install httpx`).

    python examples/hosted_api.py [http://127.0.0.1:8000]       # MUSIC3_API_KEY=KEY for a server with keys
"""

import json
import os
import sys

import httpx

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
REQUEST = {
    "model": "MiniMax-Music3",
    "prompt": "Indie folk, acoustic guitar, warm male vocals, 90 bpm",
    "lyrics": "[Verse]\nRiver running to the sea\n[Chorus]\nCarry me, carry me",
    "audio_setting": {"sample_rate": 44100, "bitrate": 256000, "format": "mp3"},
    "output_format": "hex",
    "max_new_tokens": 250,  # ours: the frame cap (25 a second: 10 s); the hosted API has none
    "seed": 7,  # ours: the same song each time (left out: a random one)
}

# The server's key, if it was started with one (serve --api-key, or MUSIC3_API_KEY).
KEY = os.environ.get("MUSIC3_API_KEY")
HEADERS = {"Authorization": f"Bearer {KEY}"} if KEY else {}

with httpx.Client(base_url=BASE, headers=HEADERS, timeout=None) as client:
    # Whole: the audio hex-encoded in the envelope.
    body = client.post("/v1/music_generation", json=REQUEST).json()
    if body["base_resp"]["status_code"] != 0:
        sys.exit(body["base_resp"]["status_msg"])
    with open("hosted.mp3", "wb") as file:
        file.write(bytes.fromhex(body["data"]["audio"]))
    print("hosted.mp3", body["extra_info"])

    # Streamed: server-sent events, a hex chunk each, then the extra_info.
    with client.stream("POST", "/v1/music_generation", json={**REQUEST, "stream": True}) as response, \
            open("hosted_stream.mp3", "wb") as file:
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                if event["base_resp"]["status_code"] != 0:
                    sys.exit(event["base_resp"]["status_msg"])
                file.write(bytes.fromhex(event["data"]["audio"]))
                if event["data"]["status"] == 2:
                    print("hosted_stream.mp3", event["extra_info"])
