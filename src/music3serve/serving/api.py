"""The HTTP API over an Engine: songs stream to the client as WAV or raw PCM while they are being written.

The server's packages (FastAPI, Starlette, pydantic, uvicorn) are imported here, in serving/request_body.py and
serving/web.py (read by this module only), and in serving/server.py and serving/http_guard.py (the uvicorn server
that runs the app), and nowhere else, so the engine core runs without them. This module
never touches CUDA: it moves events and float32 PCM that the engine has already copied to the host. Endpoints,
fields, headers and streaming semantics: docs/api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any, AsyncIterator

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from ..errors import EngineBusy, InputError, Music3Error
from .access import OWNER, Access, ErrorShape, allowed_methods, install
from .audio_io import CHANNELS, PcmEncoder, wav_header
from .engine import Accepted, AudioChunk, Done, Engine, Event, Failed, SongRequest
from .heartbeat import TALKER_STEP_LIMIT_S
from .openapi_schema import METRICS, audio_response, errors, schema_as_served
from .request_body import SONGS_PATH, BoundedBody, SongBody, describe, error_response, plain_json_object
from .web import mount_studio
from .song_stream import SEND_PIECE_BYTES, SongFailedMidStream, SongStream, watch_disconnect

log = logging.getLogger(__name__)

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "application/octet-stream"}
KEEP_FINISHED = 1024  # outcomes of finished songs kept for GET /v1/songs/{id}
# Routes whose clients expect an error body of their own (say OpenAI's {"error": {...}}), by path: their 401 and Host
# refusal come in it too (access.Access.error_shapes).
ROUTE_ERRORS: dict[str, ErrorShape] = {}
ENDING_S = 10.0  # how long a song the engine has just ended takes to send its Done or Failed (at once, in practice)


# A song is accepted within one talker step of its POST (tokenizing and a prefill at most). On a GPU the engine's
# watch fails a step past TALKER_STEP_LIMIT_S (the client then gets its 503 with the reason); waiting 30 s longer
# than that, the client gets 503 instead of an open connection where no watch applies (the CPU).
ACCEPT_TIMEOUT_S = TALKER_STEP_LIMIT_S + 30.0


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
    samples_sent: int = 0  # per channel, at the output rate, in bytes the connection accepted
    delivered: bool = False  # the song's end reached the client (its TCP acknowledged the last byte)
    frames_written: int = 0  # by the talker so far (SongService.refresh)
    windows_rendered: int = 0  # by stage 1 so far
    timings: dict[str, float] | None = None  # the engine's, once done: first_audio_s and total_s since it was queued
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


class HeldAudio:
    """A whole song's audio, read from the engine and not yet sent: it counts toward the engine's unread-audio budget
    (Engine.hold_read_audio) until the client has taken it, so clients that stop reading cannot fill the host's
    memory with finished songs."""

    def __init__(self, engine: Engine):
        self.engine, self.pieces, self.bytes = engine, deque[bytes](), 0

    def add(self, piece: bytes) -> None:
        self.engine.hold_read_audio(len(piece))
        self.pieces.append(piece)
        self.bytes += len(piece)

    async def send(self, header: bytes) -> AsyncIterator[bytes]:
        """The header, then each piece, given back to the budget once the connection has taken it."""
        yield header
        while self.pieces:
            yield self.pieces[0]
            self.engine.hold_read_audio(-len(self.pieces.popleft()))

    def release(self) -> None:
        self.engine.hold_read_audio(-sum(map(len, self.pieces)))
        self.pieces.clear()

    async def closed(self) -> None:
        self.release()


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

    def refresh(self, song: SongState) -> None:
        """A running song's frames written and windows rendered, brought up to the engine's counts."""
        progress = self.engine.progress(song.name) if song.state == "running" else None
        if progress is not None:
            song.frames_written, song.windows_rendered = max(song.frames_written, progress[0]), progress[1]

    def client_gone(self, song: SongState) -> None:
        """The client left: its song is cancelled as by a DELETE; a song the engine has already ended keeps that
        end (done or failed, as the metrics count it), not delivered."""
        if song.state == "running" and not song.stop.is_set() and self.engine.cancel(song.name):
            song.stop.set()

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
            preamble = len(wav_header(song.sample_rate)) if song.format == "wav" else 0
            return SongStream(self.stream(song, events), song, lambda: self.client_gone(song),
                              lambda: self.abandon(song, events), preamble, headers=headers,
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
        """Close the engine stream of a song whose response has ended and record the song's end. A song still running
        in the engine is cancelled there; one the engine has just ended (its client left meanwhile) gets that end,
        done or failed, so the state and the metrics agree."""
        if song.state == "running" and not song.stop.is_set() and not self.engine.cancel(song.name):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ENDING_S):
                    async for event in events:  # its Done or Failed is on its way
                        if isinstance(event, (Done, Failed)):
                            self.ended(song, event)
                            break
        await events.aclose()  # type: ignore[attr-defined]
        self.finish(song, "cancelled")

    def ended(self, song: SongState, event: Done | Failed) -> None:
        if isinstance(event, Done):
            self.refresh(song)
            song.frames = song.frames_written = event.frames
            song.ended_by, song.timings = event.ended_by, event.timings
            self.finish(song, "done")
        else:
            log.error("song failed", extra={"song": song.name, "error": event.message, "samples": song.samples_sent})
            self.finish(song, "failed", event.message)

    async def whole(self, song: SongState, events: AsyncIterator[Event], request: Request, headers: dict) -> Response:
        """The song in one response once it is done; its audio counts toward the engine's unread-audio budget until
        the client has taken it (HeldAudio), and it is sent under the streams' guard against a client that stops
        reading."""
        watcher = asyncio.ensure_future(watch_disconnect(request, lambda: self.client_gone(song)))
        held = HeldAudio(self.engine)
        try:
            async with contextlib.aclosing(self.audio(song, events, PcmEncoder(song.sample_rate))) as audio:
                async for piece in audio:
                    held.add(piece)
        except asyncio.CancelledError:  # only the server's shutdown cancels a request task (grace over, second Ctrl-C)
            asyncio.current_task().uncancel()  # answered here, on purpose: the client gets JSON, not a bare 500
            held.release()
            return error_response(503, f"the server shut down before song {song.id} was finished (songs still running "
                                       "when its shutdown grace period is over, or at a second Ctrl-C, are cut)",
                                  headers)
        finally:
            watcher.cancel()
            await self.abandon(song, events)
        if song.state != "done":
            held.release()
            if song.state == "failed":
                return error_response(500, f"song {song.id} failed: {song.error}", headers)
            return error_response(409, f"song {song.id} was cancelled before it was finished", headers)
        header = wav_header(song.sample_rate, held.bytes) if song.format == "wav" else b""
        headers["Content-Length"] = str(len(header) + held.bytes)
        return SongStream(held.send(header), song, lambda: None, held.closed, preamble=len(header), headers=headers,
                          media_type=MEDIA_TYPES[song.format])

    async def audio(self, song: SongState, events: AsyncIterator[Event], encoder: PcmEncoder) -> AsyncIterator[bytes]:
        """PCM bytes of each window as it arrives; sets the song's state when it ends."""
        while song.state == "running":
            event = await _next_event(events, song.stop)
            if event is None or (song.stop.is_set() and isinstance(event, Failed)):  # an engine ending it on cancel
                self.finish(song, "cancelled")
            elif isinstance(event, AudioChunk):
                self.refresh(song)
                data = await asyncio.to_thread(encoder.feed, event.pcm, event.last)  # numpy work off the loop
                for start in range(0, len(data), SEND_PIECE_BYTES):  # a whole song (codec_streaming false) too
                    yield data[start : start + SEND_PIECE_BYTES]
            elif isinstance(event, Done):
                tail = await asyncio.to_thread(encoder.feed, np.zeros((CHANNELS, 0), np.float32), True)
                if tail:
                    yield tail
                self.ended(song, event)
            elif isinstance(event, Failed):
                self.ended(song, event)


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

    # /openapi.json describes the endpoints (docs/api.md tells more); no /docs or /redoc pages.
    # No redirects of a trailing slash either: /v1/songs/ is an unknown path (JSON 404), not a 307 to another host's
    # idea of this one.
    app = FastAPI(title="music3serve", summary="MiniMax-Music3 songs, streamed while they are written",
                  lifespan=lifespan, docs_url=None, redoc_url=None, redirect_slashes=False)
    service = SongService(engine)
    app.state.songs = service

    app.add_middleware(BoundedBody)
    access = replace(access, error_shapes={**ROUTE_ERRORS, **access.error_shapes})
    install(app, access)
    app.openapi = partial(schema_as_served, app, app.openapi, access)  # type: ignore[method-assign]

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

    @app.post(SONGS_PATH, response_class=Response, dependencies=[Depends(plain_json_object)],
              responses={200: audio_response(MEDIA_TYPES.values()), **errors(400, 401, 409, 411, 413, 429, 500, 503)})
    async def create_song(body: SongBody, request: Request) -> Response:
        return await service.create(body, request)

    @app.get("/v1/songs/{song_id}", operation_id="song_status", responses=errors(401, 404))
    async def song_status(song_id: str, request: Request) -> JSONResponse:
        song = service.lookup(scoped(song_id, request.scope.get(OWNER)))
        if song is None:  # also another key's song: its id is not told apart from an unknown one
            # An id is at most 128 characters: a longer path is quoted cut short, not echoed whole.
            return error_response(404, f"no song {song_id!r:.132} is running or finished recently")
        service.refresh(song)
        return JSONResponse(song.public())

    @app.delete("/v1/songs/{song_id}", status_code=204, response_class=Response, operation_id="cancel_song",
                responses=errors(401))
    async def cancel_song(song_id: str, request: Request) -> Response:
        service.cancel(scoped(song_id, request.scope.get(OWNER)))
        return Response(status_code=204)

    @app.get("/health", response_model=None, responses={503: {"description": "the engine cannot take songs"}})
    @app.head("/health", response_model=None, operation_id="health_head")  # load balancers probe with either
    async def health() -> Response:
        why = engine.unavailable()
        if why is not None:
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response, responses={200: METRICS})
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type=METRICS_TYPE)

    mount_studio(app)  # the web studio at `/` (serving/web.py)
    return app
