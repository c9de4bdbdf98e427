"""The HTTP API over an Engine: songs stream to the client as WAV or raw PCM while they are being written.

The server's packages (FastAPI, Starlette, pydantic, uvicorn) are imported here, in serving/request_body.py (read by
this module only), and in serving/server.py and serving/http_guard.py (the uvicorn server that runs the app), and
nowhere else, so the engine core runs without them. This module
never touches CUDA: it moves events and float32 PCM that the engine has already copied to the host. Endpoints,
fields, headers and streaming semantics: docs/api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..errors import EngineBusy, InputError, Music3Error
from .access import OWNER, Access, allowed_methods, install
from .audio_io import CHANNELS, PcmEncoder, wav_header
from .engine import Accepted, AudioChunk, Done, Engine, Event, Failed, SongRequest
from .heartbeat import TALKER_STEP_LIMIT_S
from .request_body import SONGS_PATH, BoundedBody, SongBody, describe, error_response, plain_json_object

log = logging.getLogger(__name__)

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "application/octet-stream"}
KEEP_FINISHED = 1024  # outcomes of finished songs kept for GET /v1/songs/{id}
# The ASGI scope extension by which a server lets the app reset a connection: {"reset": callable} (serving/http_guard
# offers it). A response without the chunked encoding (HTTP/1.0) cannot say it was cut short but by a reset: a plain
# close reads as its end.
RESET = "music3serve.reset"


# A song is accepted within one talker step of its POST (tokenizing and a prefill at most). On a GPU the engine's
# watch fails a step past TALKER_STEP_LIMIT_S (the client then gets its 503 with the reason); waiting 30 s longer
# than that, the client gets 503 instead of an open connection where no watch applies (the CPU).
ACCEPT_TIMEOUT_S = TALKER_STEP_LIMIT_S + 30.0


class SongFailedMidStream(RuntimeError):
    """Raised out of a streaming response so the server drops the connection before the final chunk."""


@dataclass
class SongState:
    """What the API server knows of one song; GET /v1/songs/{id} returns it (without `stop`)."""

    id: str
    seed: int
    frame_budget: int
    format: str
    sample_rate: int
    state: str = "running"  # running | done | failed | cancelled
    error: str | None = None
    frames: int | None = None
    ended_by: str | None = None
    samples_sent: int = 0  # per channel, at the output rate
    stop: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    name: str = ""  # the engine's id of the song: `id` within its API key's own ids (scoped); default `id`

    def __post_init__(self) -> None:
        self.name = self.name or self.id

    def public(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("stop", "name")}


def scoped(song_id: str, owner: int | None) -> str:
    """The engine's id of a song of this API key (None: no keys): each key has ids of its own, so one cannot see,
    cancel or block another's songs ("/" is in no id a client may choose)."""
    return song_id if owner is None else f"{owner}/{song_id}"


async def _pull(events: AsyncIterator[Event]) -> Event:
    try:
        return await anext(events)
    except StopAsyncIteration:  # not an exception a task may carry
        return Failed("", "the engine ended the song without a Done or Failed event")


async def _next_event(events: AsyncIterator[Event], stop: asyncio.Event) -> Event | None:
    """The song's next event, or None once `stop` is set (DELETE or a client gone); then the engine generator
    is closed, which cancels the song in the engine."""
    if stop.is_set():
        return None
    step, halt = asyncio.ensure_future(_pull(events)), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({step, halt}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.cancel()
        if not step.done():
            step.cancel()  # raises CancelledError inside the engine generator: its finally cancels the song
            await asyncio.wait({step})
    return None if step.cancelled() else step.result()


async def _watch_disconnect(request: Request, stop: asyncio.Event) -> None:
    """Set `stop` when the client goes away (the request body has been read, so only http.disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stop.set()


class ClientStalled(OSError):
    """The client read nothing for WRITE_STALL_S while a piece of its song waited to be sent."""


SEND_PIECE_BYTES = 256 * 1024  # one send at most: each must drain within WRITE_STALL_S, even for a slow reader
# A client playing the stream in real time frees a window's bytes within ~8 s; one that reads nothing for this
# long is gone or stuck, and its song is cancelled rather than held (it counts toward the engine's songs).
WRITE_STALL_S = 120.0


class SongStream(StreamingResponse):
    """A streaming response that stops its song when the client disconnects or stops reading, whatever the ASGI
    version, and always closes its body generator (so the engine generator's cleanup runs at once, not at garbage
    collection)."""

    def __init__(
        self, content: AsyncIterator[bytes], song: SongState, abandon: Callable[[], Awaitable[None]], **kwargs: Any
    ):
        """`abandon` ends the song if the body never ran (the headers could not be sent): the body's own cleanup
        is in code that never started."""
        super().__init__(content, **kwargs)
        self.song, self.abandon = song, abandon

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watcher = asyncio.ensure_future(_watch_disconnect(Request(scope, receive), self.song.stop))

        async def send_or_give_up(message: dict) -> None:
            try:
                await asyncio.wait_for(send(message), WRITE_STALL_S)
            except TimeoutError:
                log.warning("client stopped reading", extra={"song": self.song.name, "samples": self.song.samples_sent})
                CutResponses.stalled += 1  # uvicorn will log this response as unfinished
                raise ClientStalled(f"the client read nothing for {WRITE_STALL_S:g} s") from None

        ended = False
        try:
            await self.stream_response(send_or_give_up)
            ended = True
        except OSError:  # the client went away between two chunks (ASGI 2.4 servers raise on send), or stalled
            self.song.stop.set()
        finally:
            watcher.cancel()
            reset = scope.get("extensions", {}).get(RESET)
            if not ended and scope.get("http_version") == "1.0" and reset:
                reset["reset"]()  # no chunked encoding to leave unfinished: only a reset says the body was cut
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            if self.song.state == "running":
                await self.abandon()


class SongService:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.running: dict[str, SongState] = {}
        self.pending: dict[str, asyncio.Event] = {}  # client-given ids still waiting for acceptance
        self.finished: OrderedDict[str, SongState] = OrderedDict()

    def lookup(self, name: str) -> SongState | None:
        """A running or recently finished song by its engine id (`scoped`)."""
        return self.running.get(name) or self.finished.get(name)

    def finish(self, song: SongState, state: str, error: str | None = None) -> None:
        if song.state == "running":
            song.state, song.error = state, error
            log.info("song ended", extra={"song": song.name, "state": song.state, "seed": song.seed,
                                          "frames": song.frames, "ended_by": song.ended_by,
                                          "samples": song.samples_sent, "error": song.error})
        if self.running.get(song.name) is song:  # not a newer song that reused the id after this one ended
            del self.running[song.name]
        if self.finished.get(song.name) is not song:  # a reused id's newest result goes to the back of the line
            self.finished.pop(song.name, None)
            self.finished[song.name] = song
        while len(self.finished) > KEEP_FINISHED:
            self.finished.popitem(last=False)

    def cancel(self, name: str) -> None:
        """DELETE: end the song's response and its work in the engine; a song the engine has already ended goes on
        to its end (its last audio, or its failure, is on its way to the client)."""
        song, cancelled = self.running.get(name), self.engine.cancel(name)
        stop = self.pending.get(name) if song is None else song.stop if cancelled else None
        if stop is not None:
            stop.set()  # ends the client's response (before the engine's Failed("cancelled") reaches it)

    async def create(self, body: SongBody, request: Request) -> Response:
        key = request.scope.get(OWNER)
        public_id = body.id if body.id is not None or key is None else uuid.uuid4().hex
        name = None if public_id is None else scoped(public_id, key)
        song_request = SongRequest(body.caption, body.lyrics, body.duration, body.seed, id=name)
        if body.steps is not None:
            song_request.steps = body.steps
        events, stop = self.engine.submit(song_request), asyncio.Event()
        owner = name is not None and self.pending.setdefault(name, stop) is stop
        try:  # wait for acceptance, so input errors are still proper HTTP errors
            first = await asyncio.wait_for(anext(events), ACCEPT_TIMEOUT_S)
        except TimeoutError:
            await events.aclose()
            message = f"the engine did not take the song within {ACCEPT_TIMEOUT_S:g} s; try again later"
            return error_response(503, message)
        except InputError as exc:  # an id taken is named as its client knows it
            return error_response(400, str(exc) if name == public_id else str(exc).replace(repr(name), repr(public_id)))
        except EngineBusy as exc:
            return error_response(429, str(exc), {"Retry-After": "10"})
        except Music3Error as exc:  # the engine is closed or a stage died: no request can be served now
            return error_response(503, f"the engine cannot take songs: {exc}")
        except BaseException:
            await events.aclose()
            raise
        finally:
            if owner:
                del self.pending[name]
        if stop.is_set():  # a DELETE of its id came before the POST could answer (accepted or not)
            await events.aclose()
            log.info("song cancelled before it was accepted", extra={"song": body.id})
            return error_response(409, f"song {body.id} was cancelled before it was accepted")
        if not isinstance(first, Accepted):
            await events.aclose()
            if isinstance(first, Failed) and first.refused:
                return error_response(400, first.message)
            why = self.engine.unavailable()
            if why is not None:  # closing, or a stage died: retry elsewhere or later
                return error_response(503, f"the engine cannot take songs: {why}")
            message = first.message if isinstance(first, Failed) else f"unexpected first event {first!r}"
            return error_response(500, message)
        song = SongState(public_id or first.song, first.seed, first.budget_frames, body.format, body.sample_rate,
                         stop=stop, name=first.song)
        self.running[song.name] = song
        headers = {
            "X-Song-Id": song.id, "X-Seed": str(song.seed), "X-Frame-Budget": str(song.frame_budget),
            "X-Prompt-Tokens": str(first.prompt_tokens), "X-Sample-Rate": str(song.sample_rate),
            "X-Channels": str(CHANNELS), "Cache-Control": "no-store",
        }
        if body.stream:
            headers["X-Accel-Buffering"] = "no"  # ask proxies not to buffer the stream
            return SongStream(self.stream(song, events), song, lambda: self.abandon(song, events), headers=headers,
                              media_type=MEDIA_TYPES[song.format])
        return await self.whole(song, events, request, headers)

    async def stream(self, song: SongState, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        encoder = PcmEncoder(song.sample_rate)
        try:
            if song.format == "wav":
                yield wav_header(song.sample_rate)
            async with contextlib.aclosing(self.audio(song, events, encoder)) as audio:
                async for data in audio:
                    yield data
            if song.state == "failed":
                raise SongFailedMidStream(f"song {song.id} failed after {song.samples_sent} samples: {song.error}")
        finally:
            await self.abandon(song, events)

    async def abandon(self, song: SongState, events: AsyncIterator[Event]) -> None:
        """Close the engine stream (which cancels a song still running there) and record the song as ended."""
        await events.aclose()  # type: ignore[attr-defined]
        self.finish(song, "cancelled")

    async def whole(self, song: SongState, events: AsyncIterator[Event], request: Request, headers: dict) -> Response:
        watcher = asyncio.ensure_future(_watch_disconnect(request, song.stop))
        try:
            async with contextlib.aclosing(self.audio(song, events, PcmEncoder(song.sample_rate))) as audio:
                data = b"".join([piece async for piece in audio])
        except asyncio.CancelledError:  # only the server's shutdown cancels a request task (grace over, second Ctrl-C)
            asyncio.current_task().uncancel()  # answered here, on purpose: the client gets JSON, not a bare 500
            return error_response(503, f"the server shut down before song {song.id} was finished (songs still running "
                                       "when its shutdown grace period is over, or at a second Ctrl-C, are cut)",
                                  headers)
        finally:
            watcher.cancel()
            await events.aclose()
            self.finish(song, "cancelled")
        if song.state == "failed":
            return error_response(500, f"song {song.id} failed: {song.error}", headers)
        if song.state != "done":
            return error_response(409, f"song {song.id} was cancelled before it was finished", headers)
        if song.format == "wav":
            data = wav_header(song.sample_rate, len(data)) + data
        return Response(data, media_type=MEDIA_TYPES[song.format], headers=headers)

    async def audio(self, song: SongState, events: AsyncIterator[Event], encoder: PcmEncoder) -> AsyncIterator[bytes]:
        """PCM bytes of each window as it arrives; sets the song's state when it ends."""
        while song.state == "running":
            event = await _next_event(events, song.stop)
            if event is None or (song.stop.is_set() and isinstance(event, Failed)):  # an engine ending it on cancel
                self.finish(song, "cancelled")
            elif isinstance(event, AudioChunk):
                data = await asyncio.to_thread(encoder.feed, event.pcm, event.last)  # numpy work off the loop
                for start in range(0, len(data), SEND_PIECE_BYTES):  # a whole song (codec_streaming false) too
                    piece = data[start : start + SEND_PIECE_BYTES]
                    yield piece
                    song.samples_sent += len(piece) // (2 * CHANNELS)  # once taken: a client gone stops the count
            elif isinstance(event, Done):
                tail = await asyncio.to_thread(encoder.feed, np.zeros((CHANNELS, 0), np.float32), True)
                if tail:
                    yield tail
                    song.samples_sent += len(tail) // (2 * CHANNELS)
                song.frames, song.ended_by = event.frames, event.ended_by
                self.finish(song, "done")
            elif isinstance(event, Failed):
                log.error("song failed",
                          extra={"song": song.name, "error": event.message, "samples": song.samples_sent})
                self.finish(song, "failed", event.message)


def create_app(engine: Engine, close_engine: bool = False, access: Access = Access()) -> FastAPI:
    """The HTTP API over a running engine; the caller owns the engine. close_engine: the app closes it when the
    server shuts down (uvicorn re-raises SIGTERM after its shutdown: under the default handler the process ends
    before any code after the server's run). access: API keys, allowed hosts and browser origins (default: open)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if close_engine:
                await asyncio.to_thread(engine.close)

    # No /docs, /redoc or /openapi.json: the API is docs/api.md's endpoints and nothing else.
    # No redirects of a trailing slash either: /v1/songs/ is an unknown path (JSON 404), not a 307 to another host's
    # idea of this one.
    app = FastAPI(title="music3serve", summary="MiniMax-Music3 songs, streamed while they are written",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    service = SongService(engine)
    app.state.songs = service

    app.add_middleware(BoundedBody)
    install(app, access)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, describe(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            methods = allowed_methods(app.router.routes, request.scope)
            return error_response(405, f"{request.method} is not allowed here; this path takes {methods}",
                                  {"Allow": methods})
        if exc.status_code in (204, 304):
            return Response(status_code=exc.status_code, headers=exc.headers)
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not decode the body
            why = str(exc.__cause__)
            if "integer string conversion" in why:  # Python's guard on decoding huge integers
                why = f"a number has more than {sys.get_int_max_str_digits()} digits"
            return error_response(400, f"the body is not valid JSON: {why}", exc.headers)
        return error_response(exc.status_code, str(exc.detail), exc.headers)

    @app.post(SONGS_PATH, response_model=None, dependencies=[Depends(plain_json_object)])
    async def create_song(body: SongBody, request: Request) -> Response:
        return await service.create(body, request)

    @app.get("/v1/songs/{song_id}")
    async def song_status(song_id: str, request: Request) -> JSONResponse:
        song = service.lookup(scoped(song_id, request.scope.get(OWNER)))
        if song is None:  # also another key's song: its id is not told apart from an unknown one
            # An id is at most 128 characters: a longer path is quoted cut short, not echoed whole.
            return error_response(404, f"no song {song_id!r:.132} is running or finished recently")
        return JSONResponse(song.public())

    @app.delete("/v1/songs/{song_id}", status_code=204, response_model=None)
    async def cancel_song(song_id: str, request: Request) -> Response:
        service.cancel(scoped(song_id, request.scope.get(OWNER)))
        return Response(status_code=204)

    @app.api_route("/health", methods=["GET", "HEAD"], response_model=None)  # load balancers probe with either
    async def health() -> Response:
        why = engine.unavailable()
        if why is not None:
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type=METRICS_TYPE)

    return app


class CutResponses(logging.Filter):
    """uvicorn logs the responses this app cuts on purpose as errors: each request task it cancels once the shutdown
    grace is over as "Exception in ASGI application" with a CancelledError traceback, and a stream SongStream ended
    because its client stopped reading as "ASGI callable returned without completing response.", and a stream cut
    because its song failed as "Exception in ASGI application" with a SongFailedMidStream traceback (the failure
    itself is logged as an error where it happened); before cutting at shutdown it says "Cancel N running task(s),
    timeout graceful shutdown exceeded". All are documented behaviour: each becomes one warning line. (Any other
    unfinished response stays an error.)"""

    stalled = 0  # streams SongStream cut for a stalled client whose unfinished response uvicorn has not logged yet

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if (isinstance(error, asyncio.CancelledError) and "graceful shutdown" in str(error)
                and message.startswith("Exception in ASGI")):
            self._warn(record, "a response was cut at shutdown (the grace period was over, or a second Ctrl-C)")
        elif isinstance(error, SongFailedMidStream) and message.startswith("Exception in ASGI"):
            self._warn(record, f"a response was cut: {error}")
        elif message.startswith("Cancel ") and message.endswith("timeout graceful shutdown exceeded"):
            self._warn(record, f"{message} (the grace period was over, or a second Ctrl-C)")
        elif message == "ASGI callable returned without completing response." and CutResponses.stalled > 0:
            CutResponses.stalled -= 1
            self._warn(record, "a response was cut: its client stopped reading (its song is cancelled)")
        return True

    @staticmethod
    def _warn(record: logging.LogRecord, message: str) -> None:
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg, record.args, record.exc_info, record.exc_text = message, (), None, None
