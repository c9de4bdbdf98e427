"""How much one engine holds: songs, and audio its callers have not read yet; the refusals past those limits; the
checks of a submitted request."""

from __future__ import annotations

import secrets
import uuid

import numpy as np

from ..acoustic.windows import song_samples
from ..errors import EngineBusy, InputError
from ..prompt import check_seed, check_steps, frames_for_duration
from .audio_io import CHANNELS
from .events import SongRequest

# Songs one engine holds, running and waiting: beyond the talker's rows they queue, and past this many a submit
# raises EngineBusy (HTTP 429) instead of growing the queue without bound.
MAX_SONGS = 1024
# Audio the songs held may still queue for callers who have not read it (a client playing a song in real time
# reads it over minutes; a six-minute song is 121 MiB of float32 PCM). A song is admitted only if its whole audio
# fits beside what the others may still hold: the engine's memory for unread audio is bounded, however slowly its
# callers read.
MAX_UNREAD_BYTES = 4 << 30
PCM_BYTES_PER_SAMPLE = CHANNELS * np.dtype(np.float32).itemsize  # the PCM an AudioChunk carries


def audio_bytes(frames: int) -> int:
    """The PCM bytes of a song of `frames` frames, as its AudioChunks carry them."""
    return song_samples(frames) * PCM_BYTES_PER_SAMPLE


def too_long(duration_s: float, audio: int, limit: int) -> InputError:
    """The refusal of a song whose `audio` bytes alone pass `limit`."""
    return InputError(f"a song of {duration_s:g} s is {audio / 2**20:.1f} MiB of audio, more than the engine holds "
                      f"for its callers ({limit / 2**20:.1f} MiB)")


def unread_refusal(unread: int, song: int, limit: int) -> EngineBusy:
    """The refusal of a song whose `song` bytes of audio, beside the `unread` bytes held for callers, pass `limit`."""
    return EngineBusy(f"the songs held have up to {unread / 2**30:.2f} GiB of audio their callers have not read; "
                      f"this song's {song / 2**20:.1f} MiB would pass the engine's {limit / 2**30:.2f} GiB: try "
                      "again when they have read it")


def checked_request(request: SongRequest, default_seed: int | None) -> tuple[str, int, int, int]:
    """The song's id, requested frames, seed and Euler steps, checked (no id: a random one; no seed: `default_seed`,
    or a random one)."""
    requested = frames_for_duration(request.duration_s)
    seed = request.seed
    if seed is None:
        seed = default_seed
    seed = check_seed(secrets.randbits(64) if seed is None else seed)
    steps = check_steps(request.steps)
    song = uuid.uuid4().hex if request.id is None else request.id
    if not isinstance(song, str) or not song:
        raise InputError(f"request id must be a non-empty string, got {song!r:.80}")
    return song, requested, seed, steps
