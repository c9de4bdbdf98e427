"""The songs of the HTTP API: submit one to the engine under its API key, wait for it to be accepted, and send its
audio as it is encoded (a stream) or once it is done (one response); each song's state is kept for GET
/v1/songs/{id} (serving/song_registry.py). POST /v1/songs, /v1/audio/speech and /v1/music_generation all serve
their songs through SongService."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import replace
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ..errors import EngineBusy, InputError, Music3Error
from ..prompt import dropped_lyrics
from .access import OWNER
from .audio_io import CHANNELS, PcmEncoder
from .encoders import MEDIA_TYPES, make_encoder
from .engine import Engine
from .error_bodies import ErrorReply, error_response
from .events import Accepted, AudioChunk, Done, Event, Failed
from .heartbeat import TALKER_STEP_LIMIT_S
from .request_body import SongBody
from .song_feed import SILENCE, next_event, window_slices
from .song_registry import SongRegistry
from .song_stream import HeldAudio, Piece, SongFailedMidStream, SongStream, pieces, watch_disconnect
from .song_types import Framing, SongOrder, SongState, Started, song_request

log = logging.getLogger(__name__)

MAX_DROPPED_SHOWN = 100  # lines named in X-Dropped-Lyrics-Lines, the first ones (a header stays short)
ENDING_S = 10.0  # how long a song the engine has just ended takes to send its Done or Failed (at once, in practice)


# A song is accepted within one talker step of its POST (tokenizing and a prefill at most). On a GPU the engine's
# watch fails a step past TALKER_STEP_LIMIT_S (the client then gets its 503 with the reason); waiting 30 s longer
# than that, the client gets 503 instead of an open connection where no watch applies (the CPU).
ACCEPT_TIMEOUT_S = TALKER_STEP_LIMIT_S + 30.0


def scoped(song_id: str, owner: int | None) -> str:
    """The engine's id of a song of this API key (None: no keys): each key has ids of its own, so one cannot see,
    cancel or block another's songs ("/" is in no id a client may choose)."""
    return song_id if owner is None else f"{owner}/{song_id}"


REQUEST_FIELDS = ("caption", "lyrics", "duration", "seed", "steps")  # SongRequest's, as the engine's messages name them


def _field_named(message: str) -> str | None:
    """The request field an engine InputError is about (its messages begin with the field's name)."""
    word = message.split(" ", 1)[0]
    return word if word in REQUEST_FIELDS else None


class SongService:
    """Each song from its request to its response, for every endpoint; the songs' states are kept in `songs`."""

    def __init__(self, engine: Engine):
        self.engine, self.songs = engine, SongRegistry(engine)

    async def create(self, body: SongBody, request: Request) -> Response:
        """POST /v1/songs."""
        song = song_request(body.caption, body.lyrics, body.duration, body.seed, body.steps, body.id)
        order = SongOrder(song, body.format, body.sample_rate, body.stream)
        started = await self.start(order, request, error_response)
        if isinstance(started, Response):
            return started
        if body.stream:
            return self.streamed(started)
        return await self.whole(started, request, error_response)

    async def start(self, order: SongOrder, request: Request, reply: ErrorReply) -> Started | Response:
        """Submit the song, under the request's API key (its ids are the key's own: `scoped`), and wait for the
        engine to accept it, so input errors are still proper HTTP errors (answered with `reply`, the endpoint's
        error body)."""
        key = request.scope.get(OWNER)
        public_id = order.request.id if order.request.id is not None or key is None else uuid.uuid4().hex
        name = None if public_id is None else scoped(public_id, key)
        song_request = replace(order.request, id=name)
        try:
            encoder = make_encoder(order.format, order.sample_rate, order.stream, order.bitrate)
        except Music3Error as exc:  # PyAV missing
            return reply(500, str(exc), param="format")
        events, stop = self.engine.submit(song_request), asyncio.Event()
        owner = name is not None and self.songs.pending.setdefault(name, stop) is stop
        try:
            first = await asyncio.wait_for(anext(events), ACCEPT_TIMEOUT_S)
        except TimeoutError:
            await events.aclose()
            message = f"the engine did not take the song within {ACCEPT_TIMEOUT_S:g} s; try again later"
            return reply(503, message)
        except InputError as exc:  # an id taken is named as its client knows it
            message = str(exc) if name == public_id else str(exc).replace(repr(name), repr(public_id))
            return reply(400, message, param=_field_named(message))
        except EngineBusy as exc:
            return reply(429, str(exc), {"Retry-After": "10"})
        except Music3Error as exc:  # the engine is closed or a stage died: no request can be served now
            return reply(503, f"the engine cannot take songs: {exc}")
        except BaseException:
            await events.aclose()
            raise
        finally:
            if owner:
                del self.songs.pending[name]
        if stop.is_set():  # a DELETE of its id came before the POST could answer (accepted or not)
            await events.aclose()
            log.info("song cancelled before it was accepted", extra={"song": name})
            return reply(409, f"song {public_id} was cancelled before it was accepted")
        if not isinstance(first, Accepted):
            await events.aclose()
            if isinstance(first, Failed) and first.refused:
                return reply(400, first.message)
            why = self.engine.unavailable()
            if why is not None:  # closing, or a stage died: retry elsewhere or later
                return reply(503, f"the engine cannot take songs: {why}")
            message = first.message if isinstance(first, Failed) else f"unexpected first event {first!r}"
            return reply(500, message)
        song = SongState(public_id or first.song, first.seed, first.budget_frames, order.format, encoder.sample_rate,
                         prompt_tokens=first.prompt_tokens, stop=stop, name=first.song)
        self.songs.running[song.name] = song
        headers = {
            "X-Song-Id": song.id, "X-Seed": str(song.seed), "X-Frame-Budget": str(song.frame_budget),
            "X-Prompt-Tokens": str(first.prompt_tokens), "X-Sample-Rate": str(song.sample_rate),
            "X-Channels": str(CHANNELS), "Cache-Control": "no-store",
        }
        if dropped := dropped_lyrics(order.request.lyrics):  # the engine logs them; the client is told here
            headers["X-Dropped-Lyrics-Lines"] = ",".join(map(str, dropped[:MAX_DROPPED_SHOWN]))
        return Started(song, events, encoder, headers)

    def streamed(self, started: Started, framing: Framing | None = None) -> SongStream:
        """The song's stream response: its audio as it is encoded, or wrapped by `framing` (say in events)."""
        framing = framing or Framing()
        headers = {**started.headers, "X-Accel-Buffering": "no"}  # ask proxies not to buffer the stream
        song, events = started.song, started.events
        return SongStream(self.stream(started, framing), song, lambda: self.songs.client_gone(song),
                          lambda: self.abandon(song, events), headers=headers,
                          media_type=framing.media_type or MEDIA_TYPES[song.format])

    async def stream(self, started: Started, framing: Framing) -> AsyncIterator[Piece]:
        song, events, encoder = started.song, started.events, started.encoder
        try:
            if header := encoder.header():
                yield framing.audio(header), 0
            try:
                async with contextlib.aclosing(self.audio(song, events, encoder)) as audio:
                    async for data, samples in audio:
                        yield framing.audio(data), samples
            except asyncio.CancelledError:  # only the server's shutdown cancels a request task (its grace is over)
                message = f"the server shut down before song {song.id} was finished"
                if ending := framing.ended_early(503, message, "server_shutdown"):
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]  # the event is sent, then the cut
                    yield ending, 0
                raise
            if song.state == "failed":
                if ending := framing.ended_early(500, f"song {song.id} failed: {song.error}", None):
                    yield ending, 0
                raise SongFailedMidStream(f"song {song.id} failed after {song.samples_sent} samples: {song.error}")
            if song.state == "cancelled":
                ending = framing.ended_early(409, f"song {song.id} was cancelled before it was finished", "cancelled")
            else:
                ending = framing.done(song) if song.state == "done" else b""
            if ending:
                yield ending, 0
        finally:
            encoder.close()
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
                            self.songs.ended(song, event)
                            break
        await events.aclose()  # type: ignore[attr-defined]
        self.songs.finish(song, "cancelled")

    async def whole(self, started: Started, request: Request, reply: ErrorReply,
                    framing: Framing | None = None) -> Response:
        """The song in one response once it is done (its file, or wrapped by `framing`, say in a JSON body), or the
        error reply of a song that did not end done. Its bytes count toward the engine's unread-audio budget until
        the client has taken them (HeldAudio), and they are sent under the streams' guard against a client that
        stops reading."""
        framing = framing or Framing()
        song, events, encoder, headers = started.song, started.events, started.encoder, started.headers
        watcher = asyncio.ensure_future(watch_disconnect(request, lambda: self.songs.client_gone(song)))
        held, size, handed_on = HeldAudio(self.engine.hold_read_audio), 0, False
        try:
            try:
                async with contextlib.aclosing(self.audio(song, events, encoder)) as audio:
                    async for data, samples in audio:
                        size += len(data)
                        held.add(framing.audio(data), samples)
            finally:
                watcher.cancel()
                encoder.close()
                await self.abandon(song, events)
            if song.state == "failed":
                return reply(500, f"song {song.id} failed: {song.error}", headers)
            if song.state != "done":
                return reply(409, f"song {song.id} was cancelled before it was finished", headers)
            opening, ending = framing.opening(encoder.whole_header(size)), framing.done(song)
            headers = {**headers, "Content-Length": str(len(opening) + held.bytes + len(ending))}
            response = SongStream(held.send(opening, ending), song, lambda: None, held.closed, headers=headers,
                                  media_type=framing.media_type or MEDIA_TYPES[song.format])
            handed_on = True  # its audio is given back as the client takes it, or when the response ends
            return response
        except asyncio.CancelledError:  # only the server's shutdown cancels a request task (grace over, second Ctrl-C)
            asyncio.current_task().uncancel()  # answered here, on purpose: the client gets JSON, not a bare 500
            return reply(503, f"the server shut down before song {song.id} was finished (songs still running "
                              "when its shutdown grace period is over, or at a second Ctrl-C, are cut)", headers)
        finally:
            if not handed_on:
                held.release()

    async def audio(self, song: SongState, events: AsyncIterator[Event], encoder: PcmEncoder) -> AsyncIterator[Piece]:
        """The encoded bytes of each window as it arrives, in pieces of at most SEND_PIECE_BYTES, each with the
        samples it encodes (a whole file's bytes come at the end, with all its samples: pro rata); sets the song's
        state when it ends, and fails it when the server cannot go on (say its encoder raised)."""
        counted = 0  # of the encoder's output samples, those given to pieces so far
        try:
            while song.state == "running":
                event = await next_event(events, song.stop)
                # None, or the engine's Failed after a cancel: ended by a DELETE or a client gone
                if event is None or (song.stop.is_set() and isinstance(event, Failed)):
                    self.songs.finish(song, "cancelled")
                elif isinstance(event, (AudioChunk, Done)):
                    if isinstance(event, AudioChunk):
                        self.songs.refresh(song)
                    feeds = (window_slices(event.pcm, event.last, first=event.window == 0)
                             if isinstance(event, AudioChunk) else [(SILENCE, True)])
                    for pcm, last in feeds:
                        data = await asyncio.to_thread(encoder.feed, pcm, last)  # numpy and codec work off the loop
                        if not data:
                            continue
                        samples, counted = encoder.samples_out - counted, encoder.samples_out
                        for piece in pieces(data, samples):  # a whole song (codec_streaming false) too
                            yield piece
                    if isinstance(event, Done):
                        self.songs.ended(song, event)
                elif isinstance(event, Failed):
                    self.songs.ended(song, event)
        except Exception as exc:  # say the encoder's: this song fails, never the server (a response ends as failed)
            if song.stop.is_set():  # a DELETE or a client gone came first: the engine has counted it cancelled
                self.songs.finish(song, "cancelled")
            else:
                self.songs.failed(song, exc)
