"""What /openapi.json says of each route beyond its request body: the media types it answers with, its response
headers and the links from a song's POST to its GET and DELETE (X-Song-Id), the statuses it sends and the error
body of each endpoint (serving/error_bodies.py), and the API keys' bearer scheme where keys are required. FastAPI's
own schema would describe audio as JSON and errors as 422 (this API answers 400): here both are put right, and
every route lists the 500 of an unexpected error."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from .access import PROTECTED, Access
from .encoders import MEDIA_TYPES
from .error_bodies import error_reply_for, error_response, minimax_error, openai_error

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
    400: "an invalid body or field (the message names it), or a Host header this server does not answer to",
    401: "no API key, or not a valid one (when the server has keys); WWW-Authenticate: Bearer",
    404: "unknown path, model or song",
    409: "cancelled before it was accepted or finished", 411: "no Content-Length, or a chunked body",
    413: "a body over 1 MiB", 429: "the engine holds all the songs or unread audio it may; Retry-After: 10",
    500: "the song failed, or could not be taken; or an unexpected error in the server",
    503: "the engine is closed or a stage died, or it did not take the song within 150 s",
}
UNEXPECTED = "an unexpected error in the server (a bug): the message gives its text, the server logs its traceback"
BODY_OF_REPLY = {error_response: "plain", openai_error: "openai", minimax_error: "minimax"}
POST_ERRORS = (400, 401, 409, 411, 413, 429, 500, 503)
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
SONG_LINKS = {name: {"operationId": operation, "parameters": {"song_id": "$response.header.X-Song-Id"}}
              for name, operation in (("SongStatus", "song_status"), ("CancelSong", "cancel_song"))}
AUDIO_CONTENT = {media: {"schema": BINARY} for media in dict.fromkeys(MEDIA_TYPES.values())}
EVENTS_CONTENT = {"text/event-stream": {"schema": TEXT}}


def error_responses(statuses: tuple[int, ...], body: str = "plain") -> dict[int | str, dict[str, Any]]:
    return {status: {"description": ERROR_WHY[status], "content": {"application/json": {"schema": ERROR_BODIES[body]}}}
            for status in statuses}


def post_responses(content: dict[str, Any], body: str, extra: tuple[int, ...] = ()) -> dict[int | str, dict]:
    """A song POST's responses: 200 with `content` and the song's headers, then its errors in shape `body`."""
    ok = {"description": "the song (streamed or whole)", "content": content, "headers": SONG_HEADERS,
          "links": SONG_LINKS}
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
    delivered: bool
    frames_written: int
    windows_rendered: int
    timings: dict[str, float] | None
    prompt_tokens: int
    first_audio_s: float | None


HEALTH_BODY = {"type": "object", "properties": {"status": TEXT, "reason": TEXT}}
HEALTH_RESPONSES = {200: {"description": "serving", "content": {"application/json": {"schema": HEALTH_BODY}}},
                    503: {"description": "closed, or a stage stopped",
                          "content": {"application/json": {"schema": HEALTH_BODY}}}}
METRICS_RESPONSES = {200: {"description": "Prometheus text", "content": {"text/plain": {"schema": TEXT}}}}
MODEL_CARD = {"type": "object", "properties": {"id": TEXT, "object": TEXT, "created": {"type": "integer"},
                                               "owned_by": TEXT}}
MODELS_RESPONSES = {200: {"description": "the served model names (OpenAI's list shape)", "content": {
    "application/json": {"schema": {"type": "object", "properties": {
        "object": TEXT, "data": {"type": "array", "items": MODEL_CARD}}}}}}, **error_responses((401,), "openai")}
MODEL_RESPONSES = {200: {"description": "a served model (OpenAI's model object)", "content": {
    "application/json": {"schema": MODEL_CARD}}}, **error_responses((401, 404), "openai")}


def openapi_schema(app: FastAPI, access: Access) -> dict[str, Any]:
    """FastAPI's schema, built once, without the 422 it adds to every route with a body (this API answers 400), with
    the 500 of an unexpected error on every route, and with the API keys' bearer scheme on /v1/ routes where keys
    are required."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                body = ERROR_BODIES[BODY_OF_REPLY[error_reply_for(path)]]  # every route may answer an unexpected 500
                responses.setdefault("500", {"description": UNEXPECTED,
                                             "content": {"application/json": {"schema": body}}})
                if access.api_keys and path.startswith(PROTECTED):
                    operation["security"] = [{"bearer": []}]
        components = schema.setdefault("components", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(name, None)
        if access.api_keys:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
    return app.openapi_schema
