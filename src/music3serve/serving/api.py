"""The HTTP API over an Engine: songs stream to the client in the format it asks for while they are being written.

POST /v1/songs is served here; POST /v1/audio/speech (serving/openai_speech.py) and POST /v1/music_generation
(serving/music_generation.py) are thin adapters over the same SongService. The server's packages (FastAPI,
Starlette, pydantic, uvicorn) and PyAV are imported by the serving/ modules of the HTTP API and the uvicorn server
only, so the engine core runs without them. This module
never touches CUDA: it moves events and float32 PCM that the engine has already copied to the host. Endpoints,
fields, headers and streaming semantics: docs/api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections import OrderedDict
from importlib.metadata import version
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .. import contract
from ..errors import EngineBusy, InputError, Music3Error
from .audio_io import CHANNELS, PcmEncoder
from .encoders import MEDIA_TYPES, make_encoder
from .engine import Accepted, AudioChunk, Done, Engine, Event, Failed, SongRequest
from .error_bodies import SONGS_PATH, ErrorReply, error_reply_for, error_response
from .heartbeat import TALKER_STEP_LIMIT_S
from .music_generation import add_music_routes
from .openai_speech import add_speech_routes
from .openapi_docs import (
    AUDIO_CONTENT, HEALTH_RESPONSES, TEXT, SongStatus, error_responses, openapi_schema, post_responses,
)
from .request_body import BoundedBody, SongBody, describe, first_field, json_object_of
from .song_types import Framing, SongOrder, SongState, Started

log = logging.getLogger(__name__)

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SILENCE = np.zeros((CHANNELS, 0), np.float32)
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


REQUEST_FIELDS = ("caption", "lyrics", "duration", "seed", "steps")  # SongRequest's, as the engine's messages name them


def _field_named(message: str) -> str | None:
    """The request field an engine InputError is about (its messages begin with the field's name)."""
    word = message.split(" ", 1)[0]
    return word if word in REQUEST_FIELDS else None


# A window goes to its encoder in slices this long, each sent once encoded: a song's first audio leaves after one
# slice's encoding, not its whole first window's (MP3 takes ~25 ms of CPU per second of audio).
FEED_SAMPLES = contract.SAMPLE_RATE // 2


def _slices(pcm: np.ndarray, last: bool) -> list[tuple[np.ndarray, bool]]:
    """A window's PCM as the encoder is fed it: FEED_SAMPLES at a time, `last` on the final slice only."""
    starts = range(0, pcm.shape[-1], FEED_SAMPLES) or [0]
    return [(pcm[..., s : s + FEED_SAMPLES], last and s + FEED_SAMPLES >= pcm.shape[-1]) for s in starts]


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
                log.warning("client stopped reading", extra={"song": self.song.id, "samples": self.song.samples_sent})
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

    def lookup(self, song: str) -> SongState | None:
        return self.running.get(song) or self.finished.get(song)

    def finish(self, song: SongState, state: str, error: str | None = None) -> None:
        if song.state == "running":
            song.state, song.error = state, error
            log.info("song ended", extra={"song": song.id, "state": song.state, "seed": song.seed,
                                          "frames": song.frames, "ended_by": song.ended_by,
                                          "samples": song.samples_sent, "error": song.error})
        if self.running.get(song.id) is song:  # not a newer song that reused the id after this one ended
            del self.running[song.id]
        if self.finished.get(song.id) is not song:  # a reused id's newest result goes to the back of the line
            self.finished.pop(song.id, None)
            self.finished[song.id] = song
        while len(self.finished) > KEEP_FINISHED:
            self.finished.popitem(last=False)

    def cancel(self, song_id: str) -> None:
        """DELETE: end the song's response and its work in the engine; a song the engine has already ended goes on
        to its end (its last audio, or its failure, is on its way to the client)."""
        song, cancelled = self.running.get(song_id), self.engine.cancel(song_id)
        stop = self.pending.get(song_id) if song is None else song.stop if cancelled else None
        if stop is not None:
            stop.set()  # ends the client's response (before the engine's Failed("cancelled") reaches it)

    async def create(self, body: SongBody, request: Request) -> Response:
        """POST /v1/songs."""
        song = SongRequest(body.caption, body.lyrics, body.duration, body.seed, id=body.id)
        if body.steps is not None:
            song.steps = body.steps
        started = await self.start(SongOrder(song, body.format, body.sample_rate, body.stream), error_response)
        if isinstance(started, Response):
            return started
        if body.stream:
            return self.streamed(started)
        data = await self.whole(started, request, error_response)
        if isinstance(data, Response):
            return data
        return Response(data, media_type=MEDIA_TYPES[started.song.format], headers=started.headers)

    async def start(self, order: SongOrder, reply: ErrorReply) -> Started | Response:
        """Submit the song and wait for the engine to accept it, so input errors are still proper HTTP errors
        (answered with `reply`, the endpoint's error shape)."""
        request = order.request
        try:
            encoder = make_encoder(order.format, order.sample_rate, order.stream, order.bitrate)
        except Music3Error as exc:  # PyAV missing
            return reply(500, str(exc), param="format")
        events, stop = self.engine.submit(request), asyncio.Event()
        owner = request.id is not None and self.pending.setdefault(request.id, stop) is stop
        try:
            first = await asyncio.wait_for(anext(events), ACCEPT_TIMEOUT_S)
        except TimeoutError:
            await events.aclose()
            message = f"the engine did not take the song within {ACCEPT_TIMEOUT_S:g} s; try again later"
            return reply(503, message)
        except InputError as exc:
            return reply(400, str(exc), param=_field_named(str(exc)))
        except EngineBusy as exc:
            return reply(429, str(exc), {"Retry-After": "10"})
        except Music3Error as exc:  # the engine is closed or a stage died: no request can be served now
            return reply(503, f"the engine cannot take songs: {exc}")
        except BaseException:
            await events.aclose()
            raise
        finally:
            if owner:
                del self.pending[request.id]
        if stop.is_set():  # a DELETE of its id came before the POST could answer (accepted or not)
            await events.aclose()
            log.info("song cancelled before it was accepted", extra={"song": request.id})
            return reply(409, f"song {request.id} was cancelled before it was accepted")
        if not isinstance(first, Accepted):
            await events.aclose()
            if isinstance(first, Failed) and first.refused:
                return reply(400, first.message)
            why = self.engine.unavailable()
            if why is not None:  # closing, or a stage died: retry elsewhere or later
                return reply(503, f"the engine cannot take songs: {why}")
            message = first.message if isinstance(first, Failed) else f"unexpected first event {first!r}"
            return reply(500, message)
        song = SongState(first.song, first.seed, first.budget_frames, order.format, encoder.sample_rate,
                         prompt_tokens=first.prompt_tokens, stop=stop)
        self.running[song.id] = song
        headers = {
            "X-Song-Id": song.id, "X-Seed": str(song.seed), "X-Frame-Budget": str(song.frame_budget),
            "X-Prompt-Tokens": str(first.prompt_tokens), "X-Sample-Rate": str(song.sample_rate),
            "X-Channels": str(CHANNELS), "Cache-Control": "no-store",
        }
        return Started(song, events, encoder, headers)

    def streamed(self, started: Started, framing: Framing | None = None) -> SongStream:
        """The song's stream response: its audio as it is encoded, or wrapped by `framing` (say in events)."""
        framing = framing or Framing()
        headers = {**started.headers, "X-Accel-Buffering": "no"}  # ask proxies not to buffer the stream
        song, events = started.song, started.events
        return SongStream(self.stream(started, framing), song, lambda: self.abandon(song, events), headers=headers,
                          media_type=framing.media_type or MEDIA_TYPES[song.format])

    async def stream(self, started: Started, framing: Framing) -> AsyncIterator[bytes]:
        song, events, encoder = started.song, started.events, started.encoder
        try:
            if header := encoder.header():
                yield framing.audio(header)
            async with contextlib.aclosing(self.audio(song, events, encoder)) as audio:
                async for data in audio:
                    yield framing.audio(data)
            if song.state == "failed":
                if ending := framing.failed(song):
                    yield ending
                raise SongFailedMidStream(f"song {song.id} failed after {song.samples_sent} samples: {song.error}")
            if song.state == "done" and (ending := framing.done(song)):
                yield ending
        finally:
            encoder.close()
            await self.abandon(song, events)

    async def abandon(self, song: SongState, events: AsyncIterator[Event]) -> None:
        """Close the engine stream (which cancels a song still running there) and record the song as ended."""
        await events.aclose()  # type: ignore[attr-defined]
        self.finish(song, "cancelled")

    async def whole(self, started: Started, request: Request, reply: ErrorReply) -> bytes | Response:
        """The whole file once the song is done, or the error reply of a song that did not end done."""
        song, events, encoder, headers = started.song, started.events, started.encoder, started.headers
        watcher = asyncio.ensure_future(_watch_disconnect(request, song.stop))
        try:
            async with contextlib.aclosing(self.audio(song, events, encoder)) as audio:
                data = b"".join([piece async for piece in audio])
        except asyncio.CancelledError:  # only the server's shutdown cancels a request task (grace over, second Ctrl-C)
            asyncio.current_task().uncancel()  # answered here, on purpose: the client gets JSON, not a bare 500
            return reply(503, f"the server shut down before song {song.id} was finished (songs still running "
                              "when its shutdown grace period is over, or at a second Ctrl-C, are cut)", headers)
        finally:
            watcher.cancel()
            encoder.close()
            await events.aclose()
            self.finish(song, "cancelled")
        if song.state == "failed":
            return reply(500, f"song {song.id} failed: {song.error}", headers)
        if song.state != "done":
            return reply(409, f"song {song.id} was cancelled before it was finished", headers)
        return encoder.whole_file(data)

    async def audio(self, song: SongState, events: AsyncIterator[Event], encoder: PcmEncoder) -> AsyncIterator[bytes]:
        """The encoded bytes of each window as it arrives; sets the song's state when it ends."""
        counted = 0  # of the encoder's output samples, those counted in samples_sent
        while song.state == "running":
            event = await _next_event(events, song.stop)
            if event is None or (song.stop.is_set() and isinstance(event, Failed)):  # an engine ending it on cancel
                self.finish(song, "cancelled")
            elif isinstance(event, (AudioChunk, Done)):
                feeds = _slices(event.pcm, event.last) if isinstance(event, AudioChunk) else [(SILENCE, True)]
                for pcm, last in feeds:
                    data = await asyncio.to_thread(encoder.feed, pcm, last)  # numpy and codec work off the loop
                    samples = encoder.samples_out - counted
                    counted += samples if data else 0  # a whole file's bytes come at the end, with all its samples
                    for start in range(0, len(data), SEND_PIECE_BYTES):  # a whole song (codec_streaming false) too
                        end = min(start + SEND_PIECE_BYTES, len(data))
                        yield data[start:end]
                        # Once taken (a client gone stops the count), the samples the bytes encode, pro rata.
                        song.samples_sent += samples * end // len(data) - samples * start // len(data)
                if isinstance(event, Done):
                    song.frames, song.ended_by = event.frames, event.ended_by
                    song.first_audio_s = event.timings.get("first_audio_s")
                    self.finish(song, "done")
            elif isinstance(event, Failed):
                log.error("song failed", extra={"song": song.id, "error": event.message, "samples": song.samples_sent})
                self.finish(song, "failed", event.message)


def create_app(engine: Engine, close_engine: bool = False,
               served_model_names: Sequence[str] = contract.SERVED_MODEL_NAMES) -> FastAPI:
    """The HTTP API over a running engine; the caller owns the engine. close_engine: the app closes it when the
    server shuts down (uvicorn re-raises SIGTERM after its shutdown: under the default handler the process ends
    before any code after the server's run). served_model_names: the `model` names requests may give (and
    GET /v1/models lists)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if close_engine:
                await asyncio.to_thread(engine.close)

    # /openapi.json describes every route (serving/openapi_docs.py), /docs renders it; no /redoc.
    # No redirects of a trailing slash: /v1/songs/ is an unknown path (JSON 404), not a 307 to another host's
    # idea of this one.
    app = FastAPI(title="music3serve", summary="MiniMax-Music3 songs, streamed while they are written",
                  version=version("music3serve"), lifespan=lifespan, redoc_url=None, redirect_slashes=False)
    service = SongService(engine)
    app.state.songs = service

    app.add_middleware(BoundedBody)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_reply_for(request.url.path)(400, describe(exc), param=first_field(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code in (204, 304):
            return Response(status_code=exc.status_code, headers=exc.headers)
        reply = error_reply_for(request.url.path)
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not decode the body
            why = str(exc.__cause__)
            if "integer string conversion" in why:  # Python's guard on decoding huge integers
                why = f"a number has more than {sys.get_int_max_str_digits()} digits"
            return reply(400, f"the body is not valid JSON: {why}", exc.headers)
        return reply(exc.status_code, str(exc.detail), exc.headers)

    @app.post(SONGS_PATH, response_model=None, dependencies=[Depends(json_object_of(SongBody))],
              operation_id="create_song", response_class=Response, responses=post_responses(AUDIO_CONTENT, "plain"))
    async def create_song(body: SongBody, request: Request) -> Response:
        return await service.create(body, request)

    add_speech_routes(app, service, served_model_names)
    add_music_routes(app, service, served_model_names)

    @app.get("/v1/songs/{song_id}", operation_id="song_status", response_model=SongStatus,
             responses=error_responses((404,)))
    async def song_status(song_id: str) -> JSONResponse:
        song = service.lookup(song_id)
        if song is None:
            # An id is at most 128 characters: a longer path is quoted cut short, not echoed whole.
            return error_response(404, f"no song {song_id!r:.132} is running or finished recently")
        return JSONResponse(song.public())

    @app.delete("/v1/songs/{song_id}", status_code=204, response_model=None, operation_id="cancel_song")
    async def cancel_song(song_id: str) -> Response:
        service.cancel(song_id)
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
             responses={200: {"description": "Prometheus text", "content": {METRICS_TYPE: {"schema": TEXT}}}})
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type=METRICS_TYPE)

    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
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
