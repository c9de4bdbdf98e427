#!/bin/sh
# Songs from the command line (curl 7.76+, jq and xxd). Start a server first: music3serve serve --tiny --device cpu
# A server with API keys: MUSIC3_API_KEY=KEY sh examples/curl.sh. An HTTP error stops the script with its body shown.
set -eu
URL=${1:-http://127.0.0.1:8000}
AUTH="Authorization: Bearer ${MUSIC3_API_KEY:-}"

# fetch FILE CURL-ARGS...: the response body into FILE. On a failure the script stops: an HTTP error shows its
# body (the server's errors are JSON), a song cut short is removed.
fetch() {
  out=$1
  shift
  if ! curl -s --fail-with-body -H "$AUTH" "$@" -o "$out"; then
    if [ "$(head -c 1 "$out" 2>/dev/null)" = "{" ]; then
      cat "$out" >&2 && echo >&2
    else
      echo "curl.sh: $out did not arrive whole" >&2
    fi
    rm -f "$out"
    exit 1
  fi
}

# POST /v1/songs: stream a WAV into a file (-N: write each piece as it arrives; -D -: print the headers).
fetch song.wav -N -D - -H 'Content-Type: application/json' \
  -d '{"caption": "Dreamy synth-pop, female vocals, 110 bpm", "lyrics": "[verse]\nneon skies\n[chorus]\nhey", "duration": 10, "seed": 7}' \
  "$URL/v1/songs"

# The same song as MP3, played while it is written (ffplay reads the stream from stdin).
# curl -sN -H 'Content-Type: application/json' -d '{"caption": "lofi hip hop", "lyrics": "[verse]\nrain", "format": "mp3"}' \
#   "$URL/v1/songs" | ffplay -nodisp -autoexit -

# POST /v1/audio/speech, the official server's contract: 32 kHz WAV, seed 0 unless given.
fetch speech.wav -H 'Content-Type: application/json' \
  -d '{"model": "MiniMax-Music3", "input": "[verse]\nneon skies", "instructions": "synth-pop", "max_new_tokens": 250}' \
  "$URL/v1/audio/speech"

# The same, streamed as Opus in Ogg (48 kHz).
fetch speech.ogg -N -H 'Content-Type: application/json' \
  -d '{"model": "MiniMax-Music3", "input": "[verse]\nneon skies", "instructions": "synth-pop", "max_new_tokens": 250, "response_format": "opus", "stream": true}' \
  "$URL/v1/audio/speech"

# POST /v1/music_generation, the hosted shape: the audio comes hex-encoded (jq and xxd turn it into a file).
fetch hosted.json -H 'Content-Type: application/json' \
  -d '{"model": "MiniMax-Music3", "prompt": "indie folk", "lyrics": "[Verse]\nriver to the sea", "max_new_tokens": 250, "seed": 7}' \
  "$URL/v1/music_generation"
jq -r .data.audio hosted.json | xxd -r -p > hosted.mp3
rm hosted.json

fetch models.json "$URL/v1/models"
cat models.json && echo
rm models.json
