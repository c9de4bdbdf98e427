"""POST /v1/audio/speech, as the official server (SGLang-Omni) serves this model in OpenAI's speech shape, and
GET /v1/models and /v1/models/{model}: a thin adapter over the song pipeline of POST /v1/songs
(serving/song_service.py's SongService).

`input` is the lyrics, `instructions` the caption; beyond the official server, `stream: true` streams the audio as
it renders and `stream_format: "sse"` sends OpenAI's speech events. Errors come in OpenAI's body shape, so its SDK
raises its own typed exceptions. Fields, defaults and errors: docs/api.md."""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any, Literal, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from .. import contract
from ..prompt import MAX_STEPS, duration_for_frames
from .encoders import FORMATS
from .engine_limits import audio_bytes
from .error_bodies import MODELS_PATH, OPENAI_TYPES, SPEECH_PATH, model_not_served, openai_error, renaming
from .openapi_docs import AUDIO_CONTENT, EVENTS_CONTENT, MODEL_RESPONSES, MODELS_RESPONSES, post_responses
from .request_body import CAPTION_LENGTH, LYRICS_LENGTH, integer_of, json_object_of, refused
from .song_types import Framing, SongOrder, SongState, server_sent_event, song_request

if TYPE_CHECKING:
    from .song_service import SongService

SPEECH_RATES = (32_000, contract.SAMPLE_RATE)
# Fields of OpenAI's and vLLM's speech APIs that the official server refuses for this model, and why.
REFUSED = {
    "temperature": "this model samples with its own fixed recipe (top-k 50, guidance 1.5): no temperature",
    "top_p": "this model samples with its own fixed recipe (top-k 50, guidance 1.5): no top_p",
    "top_k": "this model samples with its own fixed recipe (top-k 50, guidance 1.5): no top_k",
    "repetition_penalty": "this model samples with its own fixed recipe: no repetition_penalty",
    "ref_audio": "this model takes no reference audio (its audio encoder was not released)",
    "ref_text": "this model takes no reference audio, so no ref_text either",
    "language": "this model reads the language from the lyrics: no language field",
    "task_type": "this model has one task, a song from a caption and lyrics: no task_type",
}
# The engine's messages name SongRequest's fields: this endpoint's names for them.
FIELD_NAMES = {"caption": "instructions", "lyrics": "input", "duration": "max_new_tokens"}


class SpeechBody(BaseModel):
    """POST /v1/audio/speech. Types are strict; unknown keys are refused, and so are OpenAI's and vLLM's sampling and
    reference-audio fields (temperature, top_p, top_k, repetition_penalty, ref_audio, ref_text, language,
    task_type), each with the reason."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    input: str = Field(description="the lyrics, with [verse]-style tags", json_schema_extra=LYRICS_LENGTH)
    instructions: str = Field(description="the caption: style, instruments, mood, tempo",
                              json_schema_extra=CAPTION_LENGTH)
    voice: str = Field("default", description="accepted for OpenAI clients; only 'default' (or empty)",
                       json_schema_extra={"enum": ["default", ""]})
    seed: int = Field(0, ge=0, lt=contract.SEED_LIMIT)
    max_new_tokens: int = Field(contract.MAX_FRAMES, ge=1, le=contract.MAX_FRAMES,
                                description="the most frames (25 a second) the song may have; it may end sooner")
    response_format: Literal[FORMATS] = "wav"  # type: ignore[valid-type]
    sample_rate: integer_of(SPEECH_RATES) = 32_000  # type: ignore[valid-type]
    stream: bool = False
    stream_format: Literal["audio", "sse"] = "audio"
    speed: float = Field(1.0, description="only 1.0: the caption sets the tempo",
                         json_schema_extra={"minimum": 1.0, "maximum": 1.0})  # checked below, in words of ours
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="Euler steps per window; null: 30")
    # REFUSED: taken only to be refused with a reason; left out of /openapi.json, which lists what is accepted.
    temperature: SkipJsonSchema[Any] = None
    top_p: SkipJsonSchema[Any] = None
    top_k: SkipJsonSchema[Any] = None
    repetition_penalty: SkipJsonSchema[Any] = None
    ref_audio: SkipJsonSchema[Any] = None
    ref_text: SkipJsonSchema[Any] = None
    language: SkipJsonSchema[Any] = None
    task_type: SkipJsonSchema[Any] = None

    _refuse = field_validator(*REFUSED)(refused(REFUSED))

    @field_validator("voice")
    @classmethod
    def _one_voice(cls, value: str) -> str:
        if value not in ("default", ""):
            raise ValueError(f"this model has one voice, 'default' (the caption sets the singer), got {value!r:.40}")
        return value

    @field_validator("speed")
    @classmethod
    def _no_speed(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError("this model writes songs at their own tempo (set it in the caption): speed must be 1.0")
        return value


class SpeechEvents(Framing):
    """OpenAI's speech streaming events: `speech.audio.delta` with base64 audio per chunk, then `speech.audio.done`
    with usage (prompt tokens in, frames out) and ours beside it; an `error` event before a failed song's cut, or
    at the end of one cancelled."""

    media_type = "text/event-stream"

    def audio(self, data: bytes) -> bytes:
        delta = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}
        return server_sent_event(delta, "speech.audio.delta")

    def done(self, song: SongState) -> bytes:
        frames = song.frames or 0
        usage = {"input_tokens": song.prompt_tokens, "output_tokens": frames,
                 "total_tokens": song.prompt_tokens + frames}
        done = {"type": "speech.audio.done", "usage": usage, "seed": song.seed, "song_id": song.id,
                "seconds": song.samples_sent / song.sample_rate, "first_audio_s": song.first_audio_s}
        return server_sent_event(done, "speech.audio.done")

    def ended_early(self, status: int, message: str, code: str | None) -> bytes:
        error = {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": None, "code": code}
        return server_sent_event({"type": "error", "error": error}, "error")


# OpenAI's error body with this endpoint's field names, and a 429 that says how a lower max_new_tokens helps.
speech_error = renaming(
    openai_error, FIELD_NAMES, "instructions + input",
    busy_hint=f"; the engine reserves room for a song's unread audio by its max_new_tokens ({contract.MAX_FRAMES} "
              f"frames, {audio_bytes(contract.MAX_FRAMES) / 2**20:.1f} MiB, by default): a lower one reserves less")


def add_speech_routes(app: FastAPI, service: SongService, served: Sequence[str]) -> None:
    """POST /v1/audio/speech, GET /v1/models and GET /v1/models/{model} on `app`, for the model names `served`."""
    created = int(time.time())
    cards = {name: {"id": name, "object": "model", "created": created, "owned_by": "music3serve"} for name in served}

    @app.post(SPEECH_PATH, operation_id="create_speech", response_model=None, response_class=Response,
              dependencies=[Depends(json_object_of(SpeechBody))],
              responses=post_responses({**AUDIO_CONTENT, **EVENTS_CONTENT}, "openai", (404,)))
    async def create_speech(body: SpeechBody, request: Request) -> Response:
        if body.model not in served:
            return model_not_served(speech_error, body.model, served)
        song = song_request(body.instructions, body.input, duration_for_frames(body.max_new_tokens), body.seed,
                            body.steps)
        events = body.stream_format == "sse"
        order = SongOrder(song, body.response_format, body.sample_rate, stream=body.stream or events)
        started = await service.start(order, request, speech_error)
        if isinstance(started, Response):
            return started
        if order.stream:
            return service.streamed(started, SpeechEvents() if events else None)
        return await service.whole(started, request, speech_error)

    @app.get(MODELS_PATH, operation_id="list_models", response_model=None, responses=MODELS_RESPONSES)
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": list(cards.values())})

    # OpenAI's model retrieval (the SDK's models.retrieve), as the official server answers it; {model:path}: the
    # names hold a slash (MiniMaxAI/MiniMax-Music3).
    @app.get(MODELS_PATH + "/{model:path}", operation_id="retrieve_model", response_model=None,
             responses=MODEL_RESPONSES)
    async def retrieve_model(model: str) -> JSONResponse:
        if model not in cards:
            return model_not_served(speech_error, model, served, listed_at="")
        return JSONResponse(cards[model])
