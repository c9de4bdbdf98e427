"""The schema at /openapi.json, as the server answers: audio and metrics in their media types, errors as the
{"error": message} body with their real codes (FastAPI documents its 422; this server sends 400), the API keys'
bearer scheme, and the link from a song's POST to its GET and DELETE (X-Song-Id)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Callable, Iterable

from .access import PROTECTED, Access
from .request_body import ErrorBody

SONG_HEADERS = {"X-Song-Id": "string", "X-Seed": "integer", "X-Frame-Budget": "integer", "X-Prompt-Tokens": "integer",
                "X-Sample-Rate": "integer", "X-Channels": "integer"}
METRICS = {"description": "Prometheus metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}


def audio_response(media_types: Iterable[str]) -> dict[str, Any]:
    """A song's 200: its audio in these media types, its headers, and links to its state and its cancel."""
    return {
        "description": "the song's audio",
        "content": {media: {"schema": {"type": "string", "format": "binary"}} for media in media_types},
        "headers": {name: {"schema": {"type": kind}} for name, kind in SONG_HEADERS.items()},
        "links": {name: {"operationId": operation, "parameters": {"song_id": "$response.header.X-Song-Id"}}
                  for name, operation in (("SongStatus", "song_status"), ("CancelSong", "cancel_song"))},
    }


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error responses of a route: the {"error": message} body, by status."""
    return {status: {"model": ErrorBody, "description": HTTPStatus(status).phrase} for status in statuses}


def schema_as_served(app: Any, build: Callable[[], dict[str, Any]], access: Access) -> dict[str, Any]:
    """The FastAPI app's schema (`build`: FastAPI's own) without the 422 it documents for validation errors (they
    are 400s here), and with the API keys' bearer scheme on /v1/ routes where keys are required; built once."""
    if app.openapi_schema is None:
        schema = build()
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if access.api_keys and path.startswith(PROTECTED):
                    operation["security"] = [{"bearer": []}]
        components = schema.setdefault("components", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(name, None)
        if access.api_keys:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
    return app.openapi_schema
