"""The HTTP API over an Engine: songs stream to the client in the format it asks for while they are being written.

POST /v1/songs is served here; POST /v1/audio/speech (serving/openai_speech.py) and POST /v1/music_generation
(serving/music_generation.py) are thin adapters over the same SongService (serving/song_service.py). The server's
packages (FastAPI, Starlette, pydantic, uvicorn) and PyAV are imported by the serving/ modules of the HTTP API, the
web studio (serving/web.py) and the uvicorn server only, so the engine core runs without them. This module
never touches CUDA: it moves events and float32 PCM that the engine has already copied to the host. Endpoints,
fields, headers and streaming semantics: docs/api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from functools import partial
from typing import AsyncIterator, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .. import __version__, contract
from ..errors import public_text
from .access import OWNER, Access, allowed_methods, cors_headers, install, route_path
from .body_limits import BoundedBody
from .engine import Engine
from .error_bodies import SONGS_PATH, ErrorReply, error_reply_for, error_response, model_not_served, unknown_path
from .music_generation import add_music_routes
from .openai_speech import add_speech_routes
from .openapi_docs import (
    AUDIO_CONTENT, HEALTH_RESPONSES, METRICS_RESPONSES, SongStatus, error_responses, mount_docs, openapi_schema,
    post_responses,
)
from .request_body import SongBody, body_model, describe, first_field, json_object_of, not_utf8
from .song_service import SongService, scoped
from .web import mount_studio

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger(__name__)


def create_app(engine: Engine, close_engine: bool = False, access: Access = Access(),
               served_model_names: Sequence[str] = contract.SERVED_MODEL_NAMES) -> FastAPI:
    """The HTTP API over a running engine; the caller owns the engine. close_engine: the app closes it when the
    server shuts down (uvicorn re-raises SIGTERM after its shutdown: under the default handler the process ends
    before any code after the server's run). access: API keys, allowed hosts and browser origins (default: open).
    served_model_names: the `model` names requests may give (and GET /v1/models lists)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if close_engine:
                await asyncio.to_thread(engine.close)

    # /openapi.json describes every route (serving/openapi_docs.py), /docs renders it (mount_docs); no /redoc.
    # No redirects of a trailing slash: /v1/songs/ is an unknown path (JSON 404), not a 307 to another host's
    # idea of this one.
    app = FastAPI(title="music3serve", summary="MiniMax-Music3 songs, streamed while they are written",
                  version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, redirect_slashes=False)
    service = SongService(engine)
    app.state.songs = service

    app.add_middleware(BoundedBody)
    install(app, access)
    app.openapi = partial(openapi_schema, app, access)  # type: ignore[method-assign]

    def reply_for(request: Request) -> ErrorReply:
        """The error body of the request's route (serving/error_bodies.py)."""
        return error_reply_for(route_path(request.scope))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        model = body_model(request.scope)
        # A model this server does not serve comes first, as the 404 OpenAI's and MiniMax's clients look for: a
        # request written for another model (tts-1, alloy) has other fields wrong as well.
        named = exc.body.get("model") if isinstance(exc.body, dict) else None
        takes_model = model is not None and "model" in model.model_fields
        if takes_model and isinstance(named, str) and named not in served_model_names:
            return model_not_served(reply_for(request), named, served_model_names)
        message = describe(exc, model, request.headers.get("content-type"))
        return reply_for(request)(400, message, param=first_field(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        reply = reply_for(request)
        if exc.status_code == 405:
            methods = allowed_methods(app.router.routes, request.scope)
            return reply(405, f"{request.method} is not allowed here; this path takes {methods}", {"Allow": methods})
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route has the path (Starlette's own 404)
            return reply(404, unknown_path(request.url.path), exc.headers)
        if exc.status_code in (204, 304):
            return Response(status_code=exc.status_code, headers=exc.headers)
        if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI decodes UTF-8 only
            return reply(400, not_utf8(exc.__cause__), exc.headers)
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not decode the body
            why = str(exc.__cause__)
            if "integer string conversion" in why:  # Python's guard on decoding huge integers
                why = f"a number has more than {sys.get_int_max_str_digits()} digits"
            if isinstance(exc.__cause__, RecursionError):  # the parser's words name Python, not the body
                why = "its arrays and objects are nested too deeply"
            return reply(400, f"the body is not valid JSON: {why}", exc.headers)
        return reply(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """An error no route expected (a bug): a 500 in the route's error body, with our own error's text or a
        reference to its traceback, logged here (another's text may show internals), and the CORS headers of an
        allowed origin (this answer is sent from outside their middleware); Starlette then raises it on to the server,
        which closes the connection (which the answer says, so that no client sends another request on it). A
        response already started is cut instead."""
        text, reference = public_text(exc)
        log.error("unexpected error", exc_info=exc, extra={"path": request.url.path, "reference": reference})
        headers = {**cors_headers(access, request.headers.get("origin")), "Connection": "close"}
        return reply_for(request)(500, f"the server failed: {text}", headers)

    @app.post(SONGS_PATH, response_model=None, dependencies=[Depends(json_object_of(SongBody))],
              operation_id="create_song", response_class=Response, responses=post_responses(AUDIO_CONTENT, "plain"))
    async def create_song(body: SongBody, request: Request) -> Response:
        return await service.create(body, request)

    add_speech_routes(app, service, served_model_names)
    add_music_routes(app, service, served_model_names)

    @app.get("/v1/songs/{song_id}", operation_id="song_status", response_model=SongStatus,
             responses=error_responses((401, 404)))
    async def song_status(song_id: str, request: Request) -> JSONResponse:
        song = service.songs.lookup(scoped(song_id, request.scope.get(OWNER)))
        if song is None:  # also another key's song: its id is not told apart from an unknown one
            # An id is at most 128 characters: a longer path is quoted cut short, not echoed whole.
            return error_response(404, f"no song {song_id!r:.132} is running or finished recently")
        service.songs.refresh(song)
        return JSONResponse(song.public())

    @app.delete("/v1/songs/{song_id}", status_code=204, response_model=None, response_class=Response,
                operation_id="cancel_song", responses=error_responses((401,)))
    async def cancel_song(song_id: str, request: Request) -> Response:
        service.songs.cancel(scoped(song_id, request.scope.get(OWNER)))
        return Response(status_code=204)

    async def health() -> Response:
        why = engine.unavailable()
        if why is not None:
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    for method in ("GET", "HEAD"):  # load balancers probe with either; one operation each
        app.add_api_route("/health", health, methods=[method], response_model=None, responses=HEALTH_RESPONSES,
                          operation_id=f"health_{method.lower()}")

    @app.get("/metrics", response_model=None, operation_id="metrics", response_class=Response,
             responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type=METRICS_TYPE)

    mount_docs(app)
    mount_studio(app)  # the web studio at `/` (serving/web.py)
    return app
