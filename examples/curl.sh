#!/bin/sh
# Songs from the command line (curl 7.76+, jq and xxd). Start a server first: music3serve serve --tiny --device cpu
# A server with API keys: MUSIC3_API_KEY=KEY sh examples/curl.sh. An HTTP error stops the script with its body shown.
set -eu
URL=${1:-http://127.0.0.1:8000}
AUTH="Authorization: Bearer ${MUSIC3_API_KEY:-}"

# POST /v1/songs: stream a WAV into a file (-N: write each piece as it arrives; -D -: print the headers).
curl -sN --fail-with-body -D - -H "$AUTH" -H 'Content-Type: application/json' \
  -d '{"caption": "Dreamy synth-pop, female vocals, 110 bpm", "lyrics": "[verse]\nneon skies\n[chorus]\nhey", "duration": 10, "seed": 7}' \
  "$URL/v1/songs" -o song.wav

# The same song as MP3, played while it is written (ffplay reads the stream from stdin).
# curl -sN -H 'Content-Type: application/json' -d '{"caption": "lofi hip hop", "lyrics": "[verse]\nrain", "format": "mp3"}' \
#   "$URL/v1/songs" | ffplay -nodisp -autoexit -

# POST /v1/audio/speech, the official server's contract: 32 kHz WAV, seed 0 unless given.
curl -s --fail-with-body -H "$AUTH" -H 'Content-Type: application/json' \
  -d '{"model": "MiniMax-Music3", "input": "[verse]\nneon skies", "instructions": "synth-pop", "max_new_tokens": 250}' \
  "$URL/v1/audio/speech" -o speech.wav

# The same, streamed as Opus in Ogg (48 kHz).
curl -sN --fail-with-body -H "$AUTH" -H 'Content-Type: application/json' \
  -d '{"model": "MiniMax-Music3", "input": "[verse]\nneon skies", "instructions": "synth-pop", "max_new_tokens": 250, "response_format": "opus", "stream": true}' \
  "$URL/v1/audio/speech" -o speech.ogg

# POST /v1/music_generation, the hosted shape: the audio comes hex-encoded (jq and xxd turn it into a file).
curl -s --fail-with-body -H "$AUTH" -H 'Content-Type: application/json' \
  -d '{"model": "MiniMax-Music3", "prompt": "indie folk", "lyrics": "[Verse]\nriver to the sea", "max_new_tokens": 250}' \
  "$URL/v1/music_generation" | jq -r .data.audio | xxd -r -p > hosted.mp3

curl -s --fail-with-body -H "$AUTH" "$URL/v1/models"
echo
