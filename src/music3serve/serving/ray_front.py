"""The Ray Serve front: an Engine-shaped view of the engine replicas that serving/api.py serves unchanged.

The front is the application's one HTTP ingress replica. A song's POST becomes a streaming call to the engine
deployment (Ray's router picks a replica with a free song slot, or queues the call); its events come back window by
window. Every song's HTTP state (GET /v1/songs/{id}) lives here, built by api.py from the events it relays, and a
DELETE cancels the relayed call, which Ray delivers to the replica running the song: status and cancel never reach an
engine replica's request slots. A replica's call also carries the song's Progress beside its events
(serving/ray_progress.py), so GET reports frames written and windows rendered without asking the replica. Audio the front holds for clients that have not read it counts toward its own budget, as on one
engine (max_unread_bytes). Design and limits: docs/scaling.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections import OrderedDict
from typing import Any, AsyncIterator

from prometheus_client import Counter
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException, RequestCancelledError

from ..errors import EngineBusy, InputError, Music3Error
from ..prompt import frames_for_duration
from .access import OWNER
from .engine_limits import MAX_UNREAD_BYTES, audio_bytes, too_long, unread_refusal
from .events import Accepted, AudioChunk, Done, Event, Failed, SongProgress, SongRequest
from .metrics import EngineMetrics
from .song_registry import KEEP_FINISHED
from .ray_progress import Progress
from .song_service import scoped

REPLICA_HEADER = b"x-replica"  # the engine replica that holds the song, on the POST's response
def _song_audio(request: SongRequest) -> int:
    """The PCM bytes of the song the request asks for (0 for a duration the replica will refuse)."""
    try:
        return audio_bytes(frames_for_duration(request.duration_s))
    except (Music3Error, TypeError, ValueError):
        return 0


def _short(exc: BaseException) -> str:
    """An exception's first line (Ray's errors carry whole tracebacks)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _cancel(stream: Any) -> None:
    """Cancel a call to a replica. Ray's cancel re-raises what ended a call that never reached a replica (its queue
    was full, or it was cancelled while queued): that call is over, which is all a cancel asks."""
    with contextlib.suppress(RayError, RayServeException, asyncio.CancelledError, concurrent.futures.CancelledError):
        stream.cancel()


class RemoteEngine:
    """What the HTTP app needs of an Engine, over a handle to the engine replicas. Its whole surface, each as
    Engine's: submit, progress, cancel, fail, hold_read_audio, max_unread_bytes, unread_audio, unavailable, metrics,
    close (tests/test_ray_app.py checks that every `engine.X` the app's modules use is here)."""

    def __init__(self, engines: Any, max_unread_bytes: int = MAX_UNREAD_BYTES) -> None:
        """engines: a DeploymentHandle of serving/ray_app.py's engine deployment."""
        self.engines, self.max_unread_bytes = engines, max_unread_bytes
        self._streams: dict[str, Any] = {}  # song id -> its call to a replica, from its acceptance to its end
        self._waiting: set[str] = set()  # client-given ids of songs not accepted yet
        self._progress: dict[str, SongProgress] = {}  # song id -> the latest Progress its replica sent
        self._unread: dict[object, int] = {}  # per call: audio the song may still bring that api.py has not read
        self._read_audio_held = 0  # audio api.py has read but not sent yet (hold_read_audio)
        self.replica_of: OrderedDict[str, str] = OrderedDict()  # song id -> the replica tag, recent songs
        self.metrics = EngineMetrics(lambda: len(self._streams), lambda: 0, self.unread_audio)
        self._closed = False

    def submit(self, request: SongRequest) -> AsyncIterator[Event]:
        """The song's events from the replica that takes it; refusals raise as Engine.submit's do."""
        return self.metrics.counting_refusals(self._relay(request))

    async def _relay(self, request: SongRequest) -> AsyncIterator[Event]:
        if self._closed:
            raise Music3Error("the engine is closed; it takes no more songs")
        song, replica, accepted = request.id, "", False
        if song is not None and (song in self._streams or song in self._waiting):  # one id, one song, on any replica
            raise InputError(f"request id {song!r:.80} is taken by a song whose stream has not ended: wait for it or "
                             "pick another")
        call, audio = object(), _song_audio(request)
        if audio > self.max_unread_bytes:
            raise too_long(request.duration_s, audio, self.max_unread_bytes)
        if self.unread_audio() + audio > self.max_unread_bytes:
            raise unread_refusal(self.unread_audio(), audio, self.max_unread_bytes)
        started, first_audio, stream, ended, done_s = time.perf_counter(), None, None, False, None
        if song is not None:
            self._waiting.add(song)
        self._unread[call] = audio
        try:
            stream = self.engines.options(stream=True).submit.remote(request)
            async for item in stream:
                if isinstance(item, Music3Error):  # the replica's engine refused the song: the same error here
                    raise item
                if isinstance(item, str):  # the replica's first item: its tag
                    replica = item
                    continue
                if isinstance(item, Progress):
                    if accepted:
                        self._progress[song] = SongProgress(item.frames, item.windows, item.queued)
                    continue
                if isinstance(item, Accepted):
                    song, accepted = item.song, True
                    self._waiting.discard(song)
                    self._streams[song] = stream
                    self._unread[call] -= audio - audio_bytes(item.budget_frames)
                    self._remember(song, replica)
                    self.metrics.requests.inc()
                elif isinstance(item, AudioChunk):
                    self._unread[call] -= item.pcm.nbytes
                    if first_audio is None:
                        first_audio = time.perf_counter() - started
                        self.metrics.first_audio.observe(first_audio)
                if isinstance(item, Done):  # counted as the stream closes, unless its caller fails it first (fail)
                    done_s = time.perf_counter() - started
                yield item
                if isinstance(item, (Done, Failed)):
                    ended = True
                    return
        except RequestCancelledError:  # a DELETE (cancel below)
            yield Failed(song or "", "cancelled")
        except BackPressureError as exc:
            waiting = exc.args[1] if len(exc.args) > 1 else "the most"
            raise EngineBusy(f"every engine replica holds its songs and {waiting} more wait for a place (the "
                             "configured queue); try again later") from None
        except (RayError, RayServeException) as exc:  # the replica died (or none can be reached)
            if not accepted:
                raise Music3Error(f"no engine replica could take the song ({_short(exc)})") from None
            self.metrics.failures.inc()
            yield Failed(song, f"the engine replica {replica} holding the song stopped ({_short(exc)}); the other "
                               "replicas' songs go on: submit it again")
        finally:
            self._waiting.discard(request.id)  # type: ignore[arg-type]
            del self._unread[call]
            if song is not None and self._streams.get(song) is stream:
                if done_s is not None:
                    self.metrics.song_seconds.observe(done_s)
                del self._streams[song]
                self._progress.pop(song, None)
            if stream is not None and not ended:  # a call still running on its replica ends there, which cancels the
                _cancel(stream)  # song in its engine

    def _remember(self, song: str, replica: str) -> None:
        self.replica_of.pop(song, None)
        self.replica_of[song] = replica
        while len(self.replica_of) > KEEP_FINISHED:
            self.replica_of.popitem(last=False)

    def progress(self, song: str) -> SongProgress | None:
        """A running song's progress as its replica last sent it (queued until it says otherwise), or None."""
        return self._progress.get(song, SongProgress(0, 0, True)) if song in self._streams else None

    def hold_read_audio(self, nbytes: int) -> None:
        """Audio api.py has read but still holds (a whole song waiting for its client): counted toward
        max_unread_bytes beside the songs' own, as Engine.hold_read_audio."""
        self._read_audio_held += nbytes

    def unread_audio(self) -> int:
        """Bytes of audio the front holds or may still be sent for clients that have not read it."""
        return sum(self._unread.values()) + self._read_audio_held

    def cancel(self, song: str) -> bool:
        """Cancel the song's call on its replica; whether an accepted song still running had that id. A song still
        waiting for a slot is not cancelled here: api.py answers its POST with 409 once it is accepted."""
        return self._end(song, self.metrics.cancels)

    def fail(self, song: str, message: str) -> bool:
        """End the song's call on its replica, counted here as a failure (as Engine.fail, also for a song whose Done is
        out but whose stream is still open; its replica counts a cancel, and its stream ends as a cancelled one: the
        caller has recorded the failure)."""
        return self._end(song, self.metrics.failures)

    def _end(self, song: str, counter: Counter) -> bool:
        stream = self._streams.pop(song, None)
        if stream is None:
            return False
        counter.inc()
        _cancel(stream)
        return True

    def unavailable(self) -> str | None:
        """Why the front takes no songs (closed), or None. A replica whose engine broke fails Ray's health check and
        is replaced; until then the router sends songs to the others."""
        return "the engine is closed" if self._closed else None

    def close(self) -> None:
        self._closed = True
        for song in list(self._streams):
            self.cancel(song)


class ReplicaHeader:
    """ASGI middleware: a song's response names the engine replica holding it (X-Replica), read from its X-Song-Id."""

    def __init__(self, app: Any, engine: RemoteEngine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def add_replica(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                song = scoped(headers.get(b"x-song-id", b"").decode("latin-1"), scope.get(OWNER))  # the key's own id
                replica = self.engine.replica_of.get(song)
                if replica:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (REPLICA_HEADER, replica.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, add_replica)
