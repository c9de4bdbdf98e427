"""What /openapi.json says of each route beyond its request body: the media types it answers with, its response
headers and the links from a song's POST to its GET and DELETE (X-Song-Id), the statuses it sends and the error
body of each endpoint (serving/error_bodies.py), and the API keys' bearer scheme where keys are required. FastAPI's
own schema would describe audio as JSON and errors as 422 (this API answers 400): here both are put right, and
every route lists the 500 of an unexpected error."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field
from starlette.staticfiles import StaticFiles

from .access import ANY_HOST, PROTECTED, Access
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
HOST_REFUSED = "a Host header this server does not answer to (serve --allowed-hosts)"
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
        ("X-Dropped-Lyrics-Lines", "only when lyrics were dropped: the lines (from 1, comma-separated) whose text "
                                   "after a [tag] was dropped", TEXT),
    )
}
SONG_LINKS = {name: {"operationId": operation, "parameters": {"song_id": "$response.header.X-Song-Id"}}
              for name, operation in (("SongStatus", "song_status"), ("CancelSong", "cancel_song"))}
AUDIO_CONTENT = {media: {"schema": BINARY} for media in dict.fromkeys(MEDIA_TYPES.values())}
EVENTS_CONTENT = {"text/event-stream": {"schema": TEXT}}


ERROR_HEADERS = {
    401: {"WWW-Authenticate": {"description": "Bearer", "schema": TEXT}},
    429: {"Retry-After": {"description": "seconds to wait before asking again (10)", "schema": {"type": "integer"}}},
}


def error_responses(statuses: tuple[int, ...], body: str = "plain") -> dict[int | str, dict[str, Any]]:
    return {status: {"description": ERROR_WHY[status], "content": {"application/json": {"schema": ERROR_BODIES[body]}},
                     **({"headers": ERROR_HEADERS[status]} if status in ERROR_HEADERS else {})}
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
    state: Literal["queued", "running", "done", "failed", "cancelled"] = Field(
        description="queued: waiting for the talker's rows; running: being written or sent")
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


def integer_bounds(node: Any) -> None:
    """An integer field's bounds as integers, in place: FastAPI writes every bound as a float (a seed's 2**64 became
    1.8446744073709552e+19, exact for a power of two but read as a float by validators and SDK generators), and an
    exclusive bound on an integer as the inclusive one next to it."""
    if isinstance(node, list):
        for item in node:
            integer_bounds(item)
    if not isinstance(node, dict):
        return
    if node.get("type") == "integer":
        for key, step in (("exclusiveMinimum", 1), ("exclusiveMaximum", -1)):
            if key in node:
                node[key.removeprefix("exclusive").lower()] = int(node.pop(key)) + step
        for key in ("minimum", "maximum"):
            if key in node:
                node[key] = int(node[key])
    for value in node.values():
        integer_bounds(value)


def openapi_schema(app: FastAPI, access: Access) -> dict[str, Any]:
    """FastAPI's schema, built once, without the 422 it adds to every route with a body (this API answers 400), with
    the 500 of an unexpected error on every route, the Host check's 400 where it may refuse, integer bounds as
    integers, and with the API keys' bearer scheme and their 401 on /v1/ routes only where keys are required."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        integer_bounds(schema)
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                body = ERROR_BODIES[BODY_OF_REPLY[error_reply_for(path)]]  # every route may answer an unexpected 500
                responses.setdefault("500", {"description": UNEXPECTED,
                                             "content": {"application/json": {"schema": body}}})
                if "*" not in access.hosts.patterns and path not in ANY_HOST:
                    responses.setdefault("400", {"description": HOST_REFUSED,
                                                 "content": {"application/json": {"schema": body}}})
                if access.api_keys and path.startswith(PROTECTED):
                    operation["security"] = [{"bearer": []}]
                else:
                    responses.pop("401", None)
        components = schema.setdefault("components", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(name, None)
        if access.api_keys:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
    return app.openapi_schema


SWAGGER_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon.png")
DOCS_ASSETS = "/docs/assets"


def swagger_ui_files() -> Path | None:
    """The folder of Swagger UI's script, style sheet and icon that the fastapi-offline package ships (the serve
    extra installs it), found without importing it; None where it is not installed."""
    spec = importlib.util.find_spec("fastapi_offline")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if all((Path(folder) / "static" / name).is_file() for name in SWAGGER_FILES):
            return Path(folder) / "static"
    return None


def mount_docs(app: FastAPI) -> None:
    """`GET /docs`: Swagger UI over /openapi.json, its files served from here (DOCS_ASSETS) where fastapi-offline is
    installed, so the page works offline; else the browser loads them from FastAPI's default CDN."""
    files = swagger_ui_files()
    if files is not None:
        app.mount(DOCS_ASSETS, StaticFiles(directory=files), name="docs_assets")

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")  # mounted under a prefix (a Ray route_prefix)
        assets = {} if files is None else {f"swagger_{kind}_url": f"{root}{DOCS_ASSETS}/{name}" for kind, name in
                                           zip(("js", "css", "favicon"), SWAGGER_FILES)}
        return get_swagger_ui_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - API", **assets)
