"""The error bodies of the HTTP API: each endpoint answers errors in the shape its clients parse (docs/api.md).

An error reply is `reply(status, message, headers=None, param=None)`; `param` names the request field at fault,
where one is. The shape goes by path, so the app's exception handlers, the body-size middleware and any dependency
added to a route later (say an API key check raising an HTTPException) all answer in the endpoint's own shape."""

from __future__ import annotations

from typing import Protocol, Sequence

from fastapi.responses import JSONResponse

from ..prompt import PROMPT_FIELDS

SONGS_PATH = "/v1/songs"
SPEECH_PATH = "/v1/audio/speech"  # OpenAI's speech endpoint, as the official server serves it
MUSIC_PATH = "/v1/music_generation"  # MiniMax's hosted music API
MODELS_PATH = "/v1/models"
BODY_PATHS = (SONGS_PATH, SPEECH_PATH, MUSIC_PATH)  # the POST routes: the only bodies the server reads


class ErrorReply(Protocol):
    def __call__(self, status: int, message: str, headers: dict[str, str] | None = None,
                 param: str | None = None) -> JSONResponse: ...


def error_response(status: int, message: str, headers: dict[str, str] | None = None,
                   param: str | None = None) -> JSONResponse:
    """The API's own error body: {"error": message} (the message names the field)."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                409: "invalid_request_error", 411: "invalid_request_error", 413: "invalid_request_error",
                405: "invalid_request_error", 429: "rate_limit_error"}


def openai_error(status: int, message: str, headers: dict[str, str] | None = None,
                 param: str | None = None) -> JSONResponse:
    """OpenAI's error body, which its SDK turns into a typed exception (400 BadRequestError, 404 NotFoundError...)."""
    error = {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": param,
             "code": "model_not_found" if status == 404 and param == "model" else None}
    return JSONResponse({"error": error}, status_code=status, headers=headers)


# MiniMax's base_resp codes: 0 success, 1000 unknown error, 1002 rate limited, 1004 authentication failed,
# 2013 invalid parameters.
MINIMAX_CODES = {400: 2013, 401: 1004, 404: 2013, 405: 2013, 409: 2013, 411: 2013, 413: 2013, 429: 1002}


def minimax_error(status: int, message: str, headers: dict[str, str] | None = None,
                  param: str | None = None) -> JSONResponse:
    """MiniMax's envelope with no data: {"base_resp": {"status_code", "status_msg"}}, under the HTTP error status."""
    body = {"data": None, "base_resp": {"status_code": MINIMAX_CODES.get(status, 1000), "status_msg": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def renaming(reply: ErrorReply, names: dict[str, str], prompt: str, busy_hint: str = "") -> ErrorReply:
    """`reply` for an endpoint whose fields are named otherwise than SongRequest's (the engine's messages begin with
    those, and `param` names them): `names` maps them to the endpoint's, `prompt` replaces the token limit's
    PROMPT_FIELDS, and a 429's message ends with `busy_hint`."""

    def renamed(status: int, message: str, headers: dict[str, str] | None = None,
                param: str | None = None) -> JSONResponse:
        if param in names:
            message, param = names[param] + message[len(param):], names[param]
        message = message.replace(PROMPT_FIELDS, prompt) + (busy_hint if status == 429 else "")
        return reply(status, message, headers, param)

    return renamed


def unknown_path(path: str) -> str:
    """The 404 of a path no route has (a song id holds no '/': /v1/songs/a%2Fb is such a path too)."""
    return f"there is no {path!r:.100} here; the paths this server has are listed at /openapi.json"


def model_not_served(reply: ErrorReply, model: str, served: Sequence[str],
                     listed_at: str = f" (GET {MODELS_PATH})") -> JSONResponse:
    """The 404 of a `model` this server does not serve, naming those it does (and where they are listed)."""
    return reply(404, f"model {model!r:.80} is not served here; it serves {', '.join(served)}{listed_at}",
                 param="model")


_BY_PATH: dict[str, ErrorReply] = {SPEECH_PATH: openai_error, MODELS_PATH: openai_error, MUSIC_PATH: minimax_error}


def error_reply_for(path: str) -> ErrorReply:
    """The error reply of the endpoint at `path` (the API's own for the others); /v1/models/{model} is OpenAI's."""
    if path.startswith(MODELS_PATH + "/"):
        return openai_error
    return _BY_PATH.get(path, error_response)
