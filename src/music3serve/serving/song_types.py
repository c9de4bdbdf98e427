"""What the HTTP API's endpoints share about a song: its state, what an endpoint orders of the song pipeline, the
song once accepted, and how a stream's bytes are framed."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator

from .. import contract
from .audio_io import PcmEncoder
from .events import Event, SongRequest


@dataclass
class SongState:
    """What the API server knows of one song; GET /v1/songs/{id} returns it (without `stop`, `name` and `queued`)."""

    id: str
    seed: int
    frame_budget: int
    format: str
    sample_rate: int
    state: str = "running"  # running | done | failed | cancelled; public() says "queued" for a running song queued
    error: str | None = None
    frames: int | None = None
    ended_by: str | None = None
    # Per channel, at the output rate: the samples that the bytes the connection accepted encode (for a compressed
    # format, a piece of the file counts its share of the samples encoded into it).
    samples_sent: int = 0
    delivered: bool = False  # the song's end reached the client (its TCP acknowledged the last byte)
    frames_written: int = 0  # by the talker so far (SongService.refresh)
    windows_rendered: int = 0  # by stage 1 so far
    timings: dict[str, float] | None = None  # the engine's, once done: first_audio_s and total_s since it was queued
    prompt_tokens: int = 0
    first_audio_s: float | None = None  # from the POST to the first audio, once done (timings' first_audio_s)
    queued: bool = True  # waiting in the talker's queue, with no rows yet (SongRegistry.refresh)
    stop: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    name: str = ""  # the engine's id of the song: `id` within its API key's own ids (song_service.scoped); default `id`

    def __post_init__(self) -> None:
        self.name = self.name or self.id

    def public(self) -> dict[str, Any]:
        public = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("stop", "name", "queued")}
        return {**public, "state": "queued" if self.state == "running" and self.queued else self.state}


def song_request(caption: str, lyrics: str, duration_s: float, seed: int | None, steps: int | None,
                 id: str | None = None) -> SongRequest:
    """The engine's request from an endpoint's fields; `steps` None: the checkpoint's Euler steps."""
    return SongRequest(caption, lyrics, duration_s, seed, contract.DIT_STEPS if steps is None else steps, id)


@dataclass
class SongOrder:
    """What an endpoint asks of the song pipeline, whatever its body looks like: the engine's request and the
    audio's format, rate, delivery and bitrate (None: the format's default)."""

    request: SongRequest
    format: str
    sample_rate: int
    stream: bool
    bitrate: int | None = None


@dataclass
class Started:
    """A song the engine has accepted: its state, its events still to read, its encoder and response headers."""

    song: SongState
    events: AsyncIterator[Event]
    encoder: PcmEncoder
    headers: dict[str, str]


class Framing:
    """How a song's bytes go out: as they are (this class), or wrapped, say in server-sent events or a JSON body."""

    media_type: str | None = None  # None: the audio format's own

    def audio(self, data: bytes) -> bytes:
        return data

    def opening(self, header: bytes) -> bytes:
        """What a whole (not streamed) response starts with: the audio file's header, framed."""
        return self.audio(header)

    def done(self, song: SongState) -> bytes:
        """What follows the audio of a song that ended done."""
        return b""

    def ended_early(self, status: int, message: str, code: str | None) -> bytes:
        """What follows the audio of a song that failed (before the connection is dropped) or was cancelled, in the
        error shape of an HTTP `status` (500, 409) with this `message` and `code` (None: a failure)."""
        return b""


def server_sent_event(data: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event: an optional `event:` line, the JSON on one `data:` line, a blank line."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
