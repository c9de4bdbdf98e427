"""A song through the OpenAI Python SDK (`pip install openai`), as clients of the official server call it:
the whole file, the streamed bytes, and OpenAI's speech events.

    music3serve serve --tiny --device cpu      # or --model /path/to/MiniMax-Music3
    python examples/openai_sdk.py [http://127.0.0.1:8000]       # MUSIC3_API_KEY=KEY for a server with keys
"""

import base64
import json
import os
import sys

from openai import OpenAI

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
CAPTION = "Dreamy synth-pop, female vocals, 110 bpm"
LYRICS = "[verse]\nNeon skies over the bay\n[chorus]\nHold on, hold on"
# Beyond OpenAI's parameters: the seed, the frame cap (25 a second: 250 is 10 s) and the rate (32000 by default).
EXTRA = {"seed": 7, "max_new_tokens": 250}

# The server's key, if it was started with one (serve --api-key, or MUSIC3_API_KEY); else any key does.
client = OpenAI(base_url=f"{BASE}/v1", api_key=os.environ.get("MUSIC3_API_KEY") or "none")

# 1. The whole file, as the official server answers: 32 kHz 16-bit WAV.
song = client.audio.speech.create(model="MiniMax-Music3", voice="default", input=LYRICS, instructions=CAPTION,
                                  response_format="wav", extra_body=EXTRA)
song.write_to_file("song.wav")
print("song.wav, seed", song.response.headers["x-seed"])

# 2. MP3 bytes as each window renders (stream: true), written while the song is being made.
with client.audio.speech.with_streaming_response.create(
    model="MiniMax-Music3", voice="default", input=LYRICS, instructions=CAPTION, response_format="mp3",
    extra_body={**EXTRA, "stream": True},
) as response, open("song.mp3", "wb") as file:
    for chunk in response.iter_bytes():
        file.write(chunk)
print("song.mp3")

# 3. OpenAI's speech events: base64 audio deltas, then the usage (prompt tokens in, frames out).
with client.audio.speech.with_streaming_response.create(
    model="MiniMax-Music3", voice="default", input=LYRICS, instructions=CAPTION, response_format="pcm",
    stream_format="sse", extra_body=EXTRA,
) as response, open("song.pcm", "wb") as file:
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line.removeprefix("data: "))
        if event["type"] == "speech.audio.delta":
            file.write(base64.b64decode(event["audio"]))
        elif event["type"] == "speech.audio.done":
            print("song.pcm (s16le, stereo, 32 kHz), usage", event["usage"])
        elif event["type"] == "error":  # the song failed or was cancelled after its audio began
            sys.exit(f"song.pcm is cut short: {event['error']['message']}")
