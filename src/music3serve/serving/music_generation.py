"""POST /v1/music_generation in the shape of MiniMax's hosted music API, so code written for the hosted product can
self-host: a thin adapter over the song pipeline of POST /v1/songs (serving/song_service.py's SongService).

The audio comes hex-encoded in the hosted envelope (`data.audio`, `extra_info`, `base_resp`), whole or, with
`stream: true`, in server-sent events; errors come in the envelope too, under an HTTP 4xx/5xx status. Hosted fields
for what the open weights cannot do (covers, reference audio, lyrics writing, URLs to stored songs, watermarks)
are refused with a message saying so. Fields, defaults and errors: docs/api.md."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from .. import contract
from ..prompt import MAX_STEPS, duration_for_frames
from .audio_io import CHANNELS, PcmEncoder
from .error_bodies import MINIMAX_CODES, MUSIC_PATH, minimax_error, model_not_served, renaming
from .openapi_docs import EVENTS_CONTENT, post_responses
from .request_body import CAPTION_LENGTH, LYRICS_LENGTH, integer_of, json_object_of, refused
from .song_types import Framing, SongOrder, SongState, server_sent_event, song_request

if TYPE_CHECKING:
    from .song_service import SongService

MUSIC_RATES = (16_000, 24_000, 32_000, contract.SAMPLE_RATE)
BITRATES = (32_000, 64_000, 128_000, 256_000)
# The open model has no instrumental flag; an [instrumental] section with no words is how it is asked for one.
INSTRUMENTAL_LYRICS = "[instrumental]"
OK = {"status_code": 0, "status_msg": "success"}
IN_PROGRESS, COMPLETED = 1, 2  # data.status
REFUSED = {
    "audio_url": "cover songs need the audio-to-code encoder, which was not released with the open weights",
    "audio_base64": "cover songs need the audio-to-code encoder, which was not released with the open weights",
    "refer_voice": "reference audio needs the audio-to-code encoder, which was not released with the open weights",
    "refer_instrumental": "reference audio needs the audio-to-code encoder, which was not released with the open "
                          "weights",
    "refer_vocal": "reference audio needs the audio-to-code encoder, which was not released with the open weights",
}

REFUSED_SETTINGS = {
    "output_format": "'url' needs storage for finished songs, which this server does not keep: use 'hex'",
    "lyrics_optimizer": "writing lyrics takes another model, not part of the open weights: send lyrics",
    "aigc_watermark": "this server adds no watermark",
}


class AudioSetting(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    sample_rate: integer_of(MUSIC_RATES) = contract.SAMPLE_RATE  # type: ignore[valid-type]
    bitrate: integer_of(BITRATES) = 256_000  # type: ignore[valid-type]
    format: Literal["mp3", "wav", "pcm"] = "mp3"


class MusicBody(BaseModel):
    """POST /v1/music_generation. Types are strict; unknown keys are refused, and so are the hosted API's cover and
    reference-audio fields (audio_url, audio_base64, refer_voice, refer_instrumental, refer_vocal), output_format
    'url', and lyrics_optimizer or aigc_watermark true, each with the reason."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str = Field(description="the caption: style, instruments, mood, tempo", json_schema_extra=CAPTION_LENGTH)
    lyrics: str | None = Field(None, description="with [verse]-style tags; required unless is_instrumental",
                               json_schema_extra=LYRICS_LENGTH)
    stream: bool = False
    output_format: Literal["hex", "url"] = Field("hex", json_schema_extra={"enum": ["hex"]})  # url: refused, below
    audio_setting: AudioSetting = Field(default_factory=AudioSetting)
    is_instrumental: bool = False
    lyrics_optimizer: bool = Field(False, json_schema_extra={"enum": [False]})  # true: refused, below
    aigc_watermark: bool = Field(False, json_schema_extra={"enum": [False]})
    seed: int | None = Field(None, ge=0, lt=contract.SEED_LIMIT, description="ours; null: the deploy file's seed, else a random one")
    max_new_tokens: int = Field(contract.MAX_FRAMES, ge=1, le=contract.MAX_FRAMES, description="ours: the frame cap")
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="ours: Euler steps per window; null: 30")
    # REFUSED: taken only to be refused with a reason; left out of /openapi.json, which lists what is accepted.
    audio_url: SkipJsonSchema[Any] = None
    audio_base64: SkipJsonSchema[Any] = None
    refer_voice: SkipJsonSchema[Any] = None
    refer_instrumental: SkipJsonSchema[Any] = None
    refer_vocal: SkipJsonSchema[Any] = None

    _refuse = field_validator(*REFUSED)(refused(REFUSED))
    _hex_only = field_validator("output_format")(refused(REFUSED_SETTINGS, allowed=("hex",)))
    _refuse_true = field_validator("lyrics_optimizer", "aigc_watermark")(refused(REFUSED_SETTINGS, allowed=(False,)))

    @model_validator(mode="after")
    def _lyrics_or_instrumental(self) -> "MusicBody":
        if self.is_instrumental and self.lyrics:
            raise ValueError("lyrics: give lyrics or is_instrumental, not both")
        if not self.is_instrumental and self.lyrics is None:
            raise ValueError("lyrics: required unless is_instrumental is true")
        return self


def extra_info(song: SongState, setting: AudioSetting, size: int, samples: int) -> dict[str, Any]:
    """The hosted API's extra_info: duration in ms (of `samples`), rate, channels, bitrate, size in bytes."""
    return {"music_duration": round(1000 * samples / song.sample_rate), "music_sample_rate": song.sample_rate,
            "music_channel": CHANNELS, "bitrate": setting.bitrate, "music_size": size}


class HexEvents(Framing):
    """The hosted stream: a `data:` event per chunk with the audio in hex (status 1), then one with status 2, no
    audio and the extra_info; a failed song's last event carries its base_resp before the cut, and a cancelled
    song's too."""

    media_type = "text/event-stream"

    def __init__(self, setting: AudioSetting):
        self.setting, self.size = setting, 0

    def audio(self, data: bytes) -> bytes:
        self.size += len(data)
        return server_sent_event({"data": {"audio": data.hex(), "status": IN_PROGRESS}, "base_resp": OK})

    def done(self, song: SongState) -> bytes:
        info = extra_info(song, self.setting, self.size, song.samples_sent)
        return server_sent_event({"data": {"audio": "", "status": COMPLETED}, "trace_id": song.id,
                                  "extra_info": info, "base_resp": OK})

    def ended_early(self, status: int, message: str, code: str | None) -> bytes:
        base_resp = {"status_code": MINIMAX_CODES.get(status, 1000), "status_msg": message}
        return server_sent_event({"data": None, "base_resp": base_resp})


class HexEnvelope(Framing):
    """The hosted whole response: one JSON envelope, its `data.audio` the file in hex, sent piece by piece (the
    audio's hex is written between the envelope's opening and its end)."""

    media_type = "application/json"

    def __init__(self, setting: AudioSetting, encoder: PcmEncoder):
        self.setting, self.encoder, self.size = setting, encoder, 0

    def audio(self, data: bytes) -> bytes:
        self.size += len(data)
        return data.hex().encode("ascii")

    def opening(self, header: bytes) -> bytes:
        return b'{"data":{"audio":"' + self.audio(header)

    def done(self, song: SongState) -> bytes:
        info = extra_info(song, self.setting, self.size, self.encoder.samples_out)
        rest = {"trace_id": song.id, "extra_info": info, "base_resp": OK}
        return f'","status":{COMPLETED}}},{json.dumps(rest, separators=(",", ":"))[1:]}'.encode()


# MiniMax's envelope with this endpoint's field names.
music_error = renaming(minimax_error, {"caption": "prompt", "duration": "max_new_tokens"}, "prompt + lyrics")


def add_music_routes(app: FastAPI, service: SongService, served: Sequence[str]) -> None:
    """POST /v1/music_generation on `app`, for the model names `served`."""
    envelope = {"application/json": {"schema": {"type": "object"}}}

    @app.post(MUSIC_PATH, operation_id="music_generation", response_model=None, response_class=Response,
              dependencies=[Depends(json_object_of(MusicBody))],
              responses=post_responses({**envelope, **EVENTS_CONTENT}, "minimax", (404,)))
    async def music_generation(body: MusicBody, request: Request) -> Response:
        if body.model not in served:
            return model_not_served(music_error, body.model, served)
        setting = body.audio_setting
        lyrics = INSTRUMENTAL_LYRICS if body.is_instrumental else body.lyrics
        song = song_request(body.prompt, lyrics, duration_for_frames(body.max_new_tokens), body.seed, body.steps)
        order = SongOrder(song, setting.format, setting.sample_rate, body.stream, setting.bitrate)
        started = await service.start(order, request, music_error)
        if isinstance(started, Response):
            return started
        if body.stream:
            return service.streamed(started, HexEvents(setting))
        return await service.whole(started, request, music_error, HexEnvelope(setting, started.encoder))
