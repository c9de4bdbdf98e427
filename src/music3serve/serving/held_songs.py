"""The songs an engine holds for its callers: each one's record, the claim on its id and on the engine's room for
songs and unread audio, the key the stages know it by, and the delivery of its events to the caller's event loop."""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from ..errors import EngineBusy, InputError
from ..talker.events import SongFinished
from .engine_limits import audio_bytes, unread_refusal
from .events import Accepted, AudioChunk, Done, Event, Failed
from .metrics import EngineMetrics


def deliver(client: "SongClient", event: Event) -> None:
    """On the caller's loop: queue the event."""
    client.events.put_nowait(event)


_QUOTED_KEY = re.compile(r"""(['"])((?:(?!\1).)*)#\d+\1""")  # a key as repr() quotes it: 'id#7', or "it's#7"


def callers_ids(message: str) -> str:
    """A stage's message with the song keys it quotes ('id#7') shown as the callers' ids ('id')."""
    return _QUOTED_KEY.sub(r"\1\2\1", message)


@dataclass
class SongClient:
    """A held song as its caller sees it: the loop and queue its events go to, its timings and its audio owed."""

    song: str  # the caller's id; inside the engine the song is known by its key (see HeldSongs.new_key)
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    submitted: float
    first_audio: float | None = None
    finished: SongFinished | None = None
    accepted: bool = False  # stage 0 has taken it (from then on it is queued only while the talker holds it waiting)
    done_s: float | None = None  # its Done's seconds from submit, counted in music3_song_seconds as its stream closes
    ended: bool = False  # done, failed or cancelled, once: the caller gets nothing after its Done or Failed
    unread_bytes: int = 0  # PCM the song may still queue: its request's audio (its budget's once Accepted is read)
    # less the chunks read
    held_pcm: list = field(default_factory=list)  # codec_streaming false: the windows' PCM until the last
    windows: int = 0  # windows stage 1 has rendered
    read_to_end: bool = False  # the caller has been given the song's Done or Failed

    async def read(self, audio: int) -> AsyncIterator[Event]:
        """The song's events as the stages deliver them, to its Done or Failed, each read taken off its audio owed
        (`audio`: its request's, of which an Accepted gives back what its budget falls short of)."""
        while True:
            if asyncio.get_running_loop() is not self.loop:
                raise RuntimeError("a song's stream is read on the event loop that started it, not another")
            event = await self.events.get()
            if isinstance(event, AudioChunk):
                self.unread_bytes -= event.pcm.nbytes
            elif isinstance(event, Accepted):  # the budget may be short of the request (the context's room)
                self.unread_bytes -= audio - audio_bytes(event.budget_frames)
            self.read_to_end = isinstance(event, (Done, Failed))
            yield event
            if self.read_to_end:
                return


class HeldSongs:
    """The songs an engine holds, by key and by the caller's id, within its room for songs (`max_songs`) and for
    audio not yet read (`max_unread_bytes`). Callers on other threads or loops and the stage threads may race: each
    check-and-change spanning several fields is made under one lock (single dict operations rely on their atomicity)."""

    def __init__(self, max_songs: int, max_unread_bytes: int, metrics: EngineMetrics,
                 loop_gone: Callable[[str], None]):
        """loop_gone(key): a song whose caller's event loop is gone has been forgotten; its stages' work is not
        wanted any more."""
        self.max_songs, self.max_unread_bytes = max_songs, max_unread_bytes
        self.metrics, self.loop_gone = metrics, loop_gone
        self.read_audio_held = 0  # audio callers have read but still hold (hold_read_audio)
        self._clients: dict[str, SongClient] = {}  # by key
        self._keys: dict[str, str] = {}  # the caller's id -> the key of its song now held
        self._submissions = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._clients)

    def held_keys(self) -> list[str]:
        """The keys of the songs held now."""
        return list(self._clients)

    def client(self, key: str) -> SongClient | None:
        return self._clients.get(key)

    def key_of(self, song: str) -> str | None:
        """The key of the song held under the caller's id `song`, if any."""
        return self._keys.get(song)

    def new_key(self, song: str) -> str:
        """The name the stages know a submission by: the caller's id and a number of its own, so that a song
        submitted again under the id of one just cancelled or failed never receives that one's late windows,
        audio or cancels."""
        return f"{song}#{next(self._submissions)}"

    def hold(self, key: str, client: SongClient) -> None:
        """Take the submission if the engine has room for it and its id is free: checked and claimed at once
        (callers on other threads or loops may race)."""
        with self._lock:
            if len(self._clients) >= self.max_songs:
                raise EngineBusy(f"the engine holds {len(self._clients)} songs, its limit; try again when one ends")
            unread = self.unread_audio()
            if unread + client.unread_bytes > self.max_unread_bytes:
                raise unread_refusal(unread, client.unread_bytes, self.max_unread_bytes)
            if client.song in self._keys:
                raise InputError(f"request id {client.song!r:.80} is taken by a song whose stream has not ended: "
                                 "wait for it or pick another")
            self._clients[key], self._keys[client.song] = client, key

    def hold_read_audio(self, nbytes: int) -> None:
        """Audio a caller has read from its streams but still holds (say a whole song waiting for a slow client to
        take it): `nbytes` more (fewer, when negative) count toward max_unread_bytes beside the songs' own."""
        with self._lock:
            self.read_audio_held += nbytes

    def unread_audio(self) -> int:
        """Bytes of audio held for callers: what the songs held may still queue, and what callers hold read."""
        return sum(held.unread_bytes for held in list(self._clients.values())) + self.read_audio_held

    def live(self, key: str) -> bool:
        """Whether the song is held and has not ended (done, failed or cancelled)."""
        client = self._clients.get(key)
        return client is not None and not client.ended

    def count_cancel(self, key: str) -> bool:
        """End a held submission as cancelled by its caller, counted once; False if it had already ended."""
        if self.end(key) is None:
            return False
        self.metrics.cancels.inc()
        return True

    def end(self, key: str) -> SongClient | None:
        """The held submission, if this call ends it: each song ends once, as done, failed or cancelled (stage
        threads and the caller's loop may report the same song at once)."""
        with self._lock:
            client = self._clients.get(key)
            if client is None or client.ended:
                return None
            client.ended = True
            return client

    def forget(self, key: str) -> bool:
        """Drop the submission's client (and its id, if still its own); whether it was held."""
        client = self._clients.pop(key, None)
        if client is not None:
            self.release_id(client.song, key)
        return client is not None

    def release_id(self, song: str, key: str) -> None:
        """The caller's id is free again, if `key` still holds it (the caller's loop and stage threads may race)."""
        with self._lock:
            if self._keys.get(song) == key:
                del self._keys[song]

    def emit(self, key: str, event: type[Event], *args: Any) -> None:
        """Queue event(caller's id, *args) on the submission's stream, if it still has one."""
        client = self._clients.get(key)
        if client is not None:
            try:
                client.loop.call_soon_threadsafe(deliver, client, event(client.song, *args))
            except RuntimeError:  # the caller's event loop is gone; nobody is listening any more
                self.forget(key)
                self.loop_gone(key)
