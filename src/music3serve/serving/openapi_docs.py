"""What /openapi.json says of each route beyond its request body: the media types it answers with, its response
headers, the statuses it sends and the error body of each endpoint (serving/error_bodies.py). FastAPI's own
schema would describe audio as JSON and errors as 422 (this API answers 400): here both are put right."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from .encoders import MEDIA_TYPES

TEXT = {"type": "string"}
BINARY = {"type": "string", "format": "binary"}
_NULLABLE_STRING = {"type": ["string", "null"]}
ERROR_BODIES: dict[str, dict[str, Any]] = {
    "plain": {"type": "object", "required": ["error"], "properties": {"error": TEXT}},
    "openai": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": TEXT, "type": TEXT, "param": _NULLABLE_STRING, "code": _NULLABLE_STRING}}}},
    "minimax": {"type": "object", "required": ["base_resp"], "properties": {
        "data": {"type": "null"},
        "base_resp": {"type": "object", "properties": {"status_code": {"type": "integer"}, "status_msg": TEXT}}}},
}
ERROR_WHY = {
    400: "an invalid body or field (the message names it)", 404: "unknown path, model or song",
    409: "cancelled before it was accepted or finished", 411: "no Content-Length, or a chunked body",
    413: "a body over 1 MiB", 429: "the engine holds all the songs or unread audio it may; Retry-After: 10",
    500: "the song failed, or could not be taken", 503: "the engine is closed or a stage died, or it did not take "
                                                       "the song within 150 s",
}
POST_ERRORS = (400, 409, 411, 413, 429, 500, 503)
SONG_HEADERS = {
    name: {"description": why, "schema": schema}
    for name, why, schema in (
        ("X-Song-Id", "the song's id, for GET and DELETE /v1/songs/{id}", TEXT),
        ("X-Seed", "the seed used", TEXT),
        ("X-Frame-Budget", "frames (40 ms each) the song may have", {"type": "integer"}),
        ("X-Prompt-Tokens", "tokens of the conditional prompt", {"type": "integer"}),
        ("X-Sample-Rate", "the audio's sample rate", {"type": "integer"}),
        ("X-Channels", "the audio's channels (2)", {"type": "integer"}),
    )
}
AUDIO_CONTENT = {media: {"schema": BINARY} for media in dict.fromkeys(MEDIA_TYPES.values())}
EVENTS_CONTENT = {"text/event-stream": {"schema": TEXT}}


def error_responses(statuses: tuple[int, ...], body: str = "plain") -> dict[int | str, dict[str, Any]]:
    return {status: {"description": ERROR_WHY[status], "content": {"application/json": {"schema": ERROR_BODIES[body]}}}
            for status in statuses}


def post_responses(content: dict[str, Any], body: str, extra: tuple[int, ...] = ()) -> dict[int | str, dict]:
    """A song POST's responses: 200 with `content` and the song's headers, then its errors in shape `body`."""
    ok = {"description": "the song (streamed or whole)", "content": content, "headers": SONG_HEADERS}
    return {200: ok, **error_responses(tuple(sorted(POST_ERRORS + extra)), body)}


class SongStatus(BaseModel):
    """GET /v1/songs/{id}."""

    id: str
    seed: int
    frame_budget: int
    format: str
    sample_rate: int
    state: str
    error: str | None
    frames: int | None
    ended_by: str | None
    samples_sent: int
    prompt_tokens: int
    first_audio_s: float | None


HEALTH_BODY = {"type": "object", "properties": {"status": TEXT, "reason": TEXT}}
HEALTH_RESPONSES = {200: {"description": "serving", "content": {"application/json": {"schema": HEALTH_BODY}}},
                    503: {"description": "closed, or a stage stopped",
                          "content": {"application/json": {"schema": HEALTH_BODY}}}}
MODEL_CARD = {"type": "object", "properties": {"id": TEXT, "object": TEXT, "created": {"type": "integer"},
                                               "owned_by": TEXT}}
MODELS_RESPONSES = {200: {"description": "the served model names (OpenAI's list shape)", "content": {
    "application/json": {"schema": {"type": "object", "properties": {
        "object": TEXT, "data": {"type": "array", "items": MODEL_CARD}}}}}}}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, once, without the 422 it adds to every route with a body (this API answers 400)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
