"""The engine as a Python API: `submit(request)` streams events, `cancel(id)` stops a song.

The talker runs on a thread of this process with its own CUDA stream (serving/talker_loop.py); stage 1
(serving/stage1.py) is either a renderer on another thread and stream of this process (colocated: the talker keeps
writing frames while it renders) or a worker process (split). A watch thread catches a stage stuck in one call.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import AsyncIterator

import numpy as np
import torch

from ..acoustic.precision import PrecisionPolicy, apply_policy
from ..acoustic.renderer import RenderedWindow
from ..acoustic.windows import song_samples
from ..checkpoint import Music3Models, load_models
from ..errors import EngineBusy, InputError, Music3Error, error_text
from ..prompt import check_seed, check_steps, encode_prompt, frames_for_duration
from ..talker.engine import SongFinished, Talker
from ..talker.quantize import quantize_talker
from .audio_io import CHANNELS
from .deploy_config import DeployConfig, load_deploy_config
from .deploy_schema import precision_log_level
from .events import Accepted, AudioChunk, Done, Event, Failed, SongRequest
from .heartbeat import (
    PAUSE_S, RENDER_CALL, RENDER_LIMIT_PER_WINDOW_S, TALKER_CALL, TALKER_STEP_LIMIT_S, StageWatch, hang_limit,
)
from .metrics import EngineMetrics
from .render_loop import stage1_renderer
from .stage1 import LocalStage1, Stage1, WorkerStage1
from .talker_loop import Callers, TalkerLoop
from .worker import RenderWorker, load_acoustic

log = logging.getLogger(__name__)
# Songs one engine holds, running and waiting: beyond the talker's rows they queue, and past this many a submit
# raises EngineBusy (HTTP 429) instead of growing the queue without bound.
MAX_SONGS = 1024
# Audio the songs held may still queue for callers who have not read it (a client playing a song in real time
# reads it over minutes; a six-minute song is 127 MB of float32 PCM). A song is admitted only if its whole audio
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


def _deliver(client: "_Client", event: Event) -> None:
    """On the caller's loop: queue the event."""
    client.events.put_nowait(event)


def caller_id(key: str) -> str:
    """The caller's id of a song key the stages know (Engine._key)."""
    return key.rpartition("#")[0]


_QUOTED_KEY = re.compile(r"""(['"])((?:(?!\1).)*)#\d+\1""")  # a key as repr() quotes it: 'id#7', or "it's#7"


def _callers_ids(message: str) -> str:
    """A stage's message with the song keys it quotes ('id#7') shown as the callers' ids ('id')."""
    return _QUOTED_KEY.sub(r"\1\2\1", message)


@dataclass
class _Client:
    song: str  # the caller's id; inside the engine the song is known by its key (see Engine._key)
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    submitted: float
    first_audio: float | None = None
    finished: SongFinished | None = None
    ended: bool = False  # done, failed or cancelled, once: the caller gets nothing after its Done or Failed
    unread_bytes: int = 0  # PCM the song may still queue: its request's audio (its budget's once Accepted is read)
    # less the chunks read
    held_pcm: list = field(default_factory=list)  # codec_streaming false: the windows' PCM until the last
    windows: int = 0  # windows stage 1 has rendered


class Engine:
    def __init__(self, models: Music3Models, deploy: DeployConfig | None = None, worker: RenderWorker | None = None):
        """Colocated: both stages here (models hold all five components). Split: stage 1 runs in `worker`."""
        deploy = deploy or load_deploy_config()
        self.deploy, self.models = deploy, models
        self.tokenizer = models.tokenizer
        self.device = models.language_model.embed.weight.device
        log.log(precision_log_level(deploy.stages[1].precision, self.device.type), "stage precision",
                extra=deploy.precisions())
        started = time.perf_counter()
        if worker is None:  # stage 1's weights in their precision first: the float32 copies are gone before the KV
            apply_policy(models.condition_encoder, models.dit, models.vocoder,
                         PrecisionPolicy.named(deploy.stages[1].precision))
        policy_s, started = time.perf_counter() - started, time.perf_counter()  # stage 1's part, before the talker's
        if deploy.stages[0].quantization == "fp8":
            quantize_talker(models.language_model, models.depth_decoder)
        self.talker = Talker(
            models.language_model, models.depth_decoder, models.condition_encoder, deploy.talker_config()
        )
        talker_ready = time.perf_counter()
        self.worker = worker  # (split) and self.renderer (colocated): for callers and tests; the engine uses stage1
        if worker is None:
            self.renderer = stage1_renderer(models, deploy.stages[1])
        # Seconds from loaded weights to ready, per stage in this process (a worker's renderer gets ready in its own).
        self.ready_s = {"talker": talker_ready - started}
        if worker is None:
            self.ready_s["renderer"] = policy_s + time.perf_counter() - talker_ready
        log.info("engine ready", extra={f"{part}_s": s for part, s in self.ready_s.items()})
        self.metrics = EngineMetrics(lambda: len(self._clients), lambda: len(self.talker.waiting), self.unread_audio)
        self.max_songs, self.max_unread_bytes = MAX_SONGS, MAX_UNREAD_BYTES
        self._read_audio_held = 0  # audio callers have read but still hold (hold_read_audio)
        self._clients: dict[str, _Client] = {}  # by key
        self._keys: dict[str, str] = {}  # the caller's id -> the key of its song now held
        self._submissions = itertools.count()
        self._stop = threading.Event()
        self._closed = False
        self._failing = threading.Lock()
        self._broken: str | None = None  # why a stage thread died; the engine then refuses work
        # The stage threads of this process, watched for a call that never ends (the worker has its own watch).
        limit = partial(hang_limit, self.device.type)
        self.stage_watches = {"stage 0": StageWatch(limit(TALKER_STEP_LIMIT_S), TALKER_CALL)}
        if worker is None:
            self.stage_watches["stage 1"] = StageWatch(limit(RENDER_LIMIT_PER_WINDOW_S), RENDER_CALL)
            self.stage1: Stage1 = LocalStage1(
                self.renderer, self._on_chunk, self._fail_and_cancel, self._stop, self.stage_watches["stage 1"]
            )
        else:
            self.stage1 = WorkerStage1(worker, self.device, self._on_chunk, self._fail_and_cancel, self._stop)
        self._hung_stage: str | None = None  # the stage whose thread the watch found stuck in one call
        callers = Callers(live=self._live, accepted=self._accepted, refused=self._refused, finished=self._finished,
                          fail=self._fail)
        self.talker_loop = TalkerLoop(self.talker, callers, self.stage1, self.stage_watches["stage 0"], self.metrics,
                                      self._stop, deploy.async_chunk)
        self._threads = [
            threading.Thread(target=self._guarded, args=(self.talker_loop.run,), name="music3-talker", daemon=True),
            threading.Thread(target=self._guarded, args=(self.stage1.run,), name="music3-stage1", daemon=True),
            threading.Thread(target=self._guarded, args=(self._watch_loop,), name="music3-watch", daemon=True),
        ]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # start-up work on the default stream is done before the stages run
        for thread in self._threads:
            thread.start()

    @classmethod
    def from_pretrained(
        cls, root: Path | str, deploy: DeployConfig | None = None, device: str | torch.device | None = None,
        split: bool | None = None,
        progress: bool = False,
    ) -> "Engine":
        """Stages whose `devices` differ run split (stage 1 in a worker process); `device` overrides both stages'
        devices (e.g. "cpu" for tests); `split` forces the placement either way. Without CUDA both stages run on the
        CPU in this process, whatever `devices` say. progress: bars while this process loads its weights."""
        deploy = deploy or load_deploy_config()
        s0, s1 = deploy.stages
        if device is None and torch.cuda.is_available():
            count = torch.cuda.device_count()
            for name, stage in (("stage 0", s0), ("stage 1", s1)):
                if stage.devices[0] >= count:
                    raise Music3Error(f"{name} is placed on GPU {stage.devices[0]} (deploy config `devices`), but "
                                      f"this machine has {count} CUDA device(s): 0 to {count - 1}")
            device0, device1 = (f"cuda:{s.devices[0]}" for s in (s0, s1))
        elif device is None:
            device0 = device1 = "cpu"
            log.warning("no CUDA device: both stages run on the CPU in this process (deploy `devices` ignored)")
        else:
            try:
                device0 = device1 = str(torch.device(device))
            except (RuntimeError, TypeError) as e:
                raise Music3Error(f"device override {device!r} is not a torch device ({e})") from None
            shares = s0.gpu_memory_utilization + s1.gpu_memory_utilization
            if torch.device(device).type == "cuda" and shares > 1:  # the file's own check saw two GPUs
                raise Music3Error(f"both stages run on {device} (the device override), but their deploy config "
                                  f"gpu_memory_utilization add up to {shares:g} > 1: lower them, or leave the stages "
                                  "on the GPUs their `devices` name")
        split = device0 != device1 if split is None else split
        talker_dtype = getattr(torch, s0.dtype) if torch.device(device0).type != "cpu" else torch.float32
        models = load_models(Path(root), device=device0, talker_dtype=talker_dtype, acoustic=not split,
                             progress=progress, quantization=s0.quantization)
        worker = RenderWorker(partial(load_acoustic, str(root)), device1, s1, deploy.connector) if split else None
        try:
            return cls(models, deploy, worker)
        except BaseException:
            if worker is not None:
                worker.close()
            raise

    # Public API.
    def submit(self, request: SongRequest) -> AsyncIterator[Event]:
        """Validate, queue and stream one song's events; bad input raises InputError before anything is queued, and
        a closed or broken engine raises Music3Error. Songs beyond the talker's rows wait in its queue, up to
        `max_songs` held in all; past that, EngineBusy."""
        return self.metrics.counting_refusals(self._submit(request))

    async def _submit(self, request: SongRequest) -> AsyncIterator[Event]:
        if not isinstance(request, SongRequest):
            raise InputError(f"submit takes a SongRequest, got {type(request).__name__}: {request!r:.80}")
        # Tokenizing a long caption takes a while: off the caller's event loop (the other streams keep flowing).
        cond, uncond = await asyncio.to_thread(encode_prompt, self.tokenizer, request.caption, request.lyrics)
        song, budget_request, seed, steps = self._validate(request)
        audio = audio_bytes(budget_request)
        if audio > self.max_unread_bytes:
            raise too_long(request.duration_s, audio, self.max_unread_bytes)
        client = _Client(song, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter(), unread_bytes=audio)
        key = self._key(song)
        self._hold(key, client)
        if self._stop.is_set() or self._broken:  # after registering: close() and a dying stage fail all they see
            self._forget(key)
            raise Music3Error(self._broken or "the engine is closed; it takes no more songs")
        self.talker_loop.submit(key, cond, uncond, seed, budget_request, steps)
        ended = False
        try:
            while not ended:
                if asyncio.get_running_loop() is not client.loop:
                    raise RuntimeError("a song's stream is read on the event loop that started it, not another")
                event = await client.events.get()
                if isinstance(event, AudioChunk):
                    client.unread_bytes -= event.pcm.nbytes
                elif isinstance(event, Accepted):  # the budget may be short of the request (the context's room)
                    client.unread_bytes -= audio - audio_bytes(event.budget_frames)
                ended = isinstance(event, (Done, Failed))
                yield event
        finally:
            if not ended:  # the caller stopped reading before the end
                self._count_cancel(key)
            if self._forget(key):
                self._cancel(key)

    def _hold(self, key: str, client: _Client) -> None:
        """Take the submission if the engine has room for it and its id is free: checked and claimed at once
        (callers on other threads or loops may race)."""
        with self._failing:
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
        with self._failing:
            self._read_audio_held += nbytes

    def unread_audio(self) -> int:
        """Bytes of audio held for callers: what the songs held may still queue, and what callers hold read."""
        return sum(held.unread_bytes for held in list(self._clients.values())) + self._read_audio_held

    def cancel(self, song: str) -> bool:
        """Stop a song wherever it is; its stream ends with Failed("cancelled"), its rows and windows are freed.
        Whether it did: an id the engine does not hold, or whose song has ended (its Done or Failed is on its way to
        the caller), is ignored. A song is held from the first read of its stream (submit starts nothing until
        then): cancelling it earlier returns False; closing the unread stream is how to drop it."""
        if not isinstance(song, str):
            raise InputError(f"cancel takes a song's id (a string), got {type(song).__name__}: {song!r:.80}")
        key = self._keys.get(song)
        if key is None or not self._count_cancel(key):
            return False
        self._release_id(song, key)  # the id is free at once (its stream still ends with Failed("cancelled"))
        self._cancel(key)
        return True

    def progress(self, song: str) -> tuple[int, int] | None:
        """(frames written, windows rendered) of the song held under the caller's id `song`, or None. Read from
        the caller's thread while the stages run: each count may be a step behind, and frames read 0 once the
        talker has let the song go (its Done carries the final count)."""
        key = self._keys.get(song)
        client = self._clients.get(key) if key is not None else None
        if client is None:
            return None
        finished, decoding = client.finished, self.talker.songs.get(key)
        frames = finished.frames if finished is not None else decoding.frames if decoding is not None else 0
        return frames, client.windows

    def _count_cancel(self, key: str) -> bool:
        """End a held submission as cancelled by its caller, counted once; False if it had already ended."""
        if self._end(key) is None:
            return False
        self.metrics.cancels.inc()
        return True

    def _end(self, key: str) -> _Client | None:
        """The held submission, if this call ends it: each song ends once, as done, failed or cancelled (stage
        threads and the caller's loop may report the same song at once)."""
        with self._failing:
            client = self._clients.get(key)
            if client is None or client.ended:
                return None
            client.ended = True
            return client

    def _key(self, song: str) -> str:
        """The name the stages know a submission by: the caller's id and a number of its own, so that a song
        submitted again under the id of one just cancelled or failed never receives that one's late windows,
        audio or cancels."""
        return f"{song}#{next(self._submissions)}"

    def _forget(self, key: str) -> bool:
        """Drop the submission's client (and its id, if still its own); whether it was held."""
        client = self._clients.pop(key, None)
        if client is not None:
            self._release_id(client.song, key)
        return client is not None

    def _release_id(self, song: str, key: str) -> None:
        """The caller's id is free again, if `key` still holds it (the caller's loop and stage threads may race)."""
        with self._failing:
            if self._keys.get(song) == key:
                del self._keys[song]

    def _cancel(self, key: str) -> None:
        self.talker_loop.cancel(key)  # first: a retry under the same id is a new key anyway
        self.stage1.drop_waits(key)  # now; again once the talker has stopped sending the song's windows
        self._emit(key, Failed, "cancelled")

    def unavailable(self) -> str | None:
        """Why the engine takes no songs (closed, or a stage died), or None while it serves."""
        if self._broken:
            return self._broken
        return "the engine is closed" if self._stop.is_set() else None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop both stages; every open stream ends with Failed("engine closed"), later submits raise Music3Error.
        Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()  # first, so a submit racing with close either sees it or is failed below
        for key in list(self._clients):
            self._emit(key, Failed, "engine closed")
        self.talker_loop.wake()
        self.stage1.stop()
        talker, stage1, watch = self._threads
        # A thread the watch found stuck is not waited for (it may never return; it is a daemon).
        stuck = {"stage 0": talker, "stage 1": stage1}.get(self._hung_stage)
        talker.join(timeout=0 if talker is stuck else 30)
        self.stage1.close()
        for thread in (stage1, watch):
            thread.join(timeout=0 if thread is stuck else 30)

    def _validate(self, request: SongRequest) -> tuple[str, int, int, int]:
        """The song's id, requested frames, seed and Euler steps, checked."""
        requested = frames_for_duration(request.duration_s)
        seed = request.seed
        if seed is None:
            seed = self.deploy.stages[0].default_sampling_params.seed
        seed = check_seed(secrets.randbits(64) if seed is None else seed)
        steps = check_steps(request.steps)
        song = uuid.uuid4().hex if request.id is None else request.id
        if not isinstance(song, str) or not song:
            raise InputError(f"request id must be a non-empty string, got {song!r:.80}")
        return song, requested, seed, steps

    def _emit(self, key: str, event: type[Event], *args) -> None:
        """Queue event(caller's id, *args) on the submission's stream, if it still has one."""
        client = self._clients.get(key)
        if client is not None:
            try:
                client.loop.call_soon_threadsafe(_deliver, client, event(client.song, *args))
            except RuntimeError:  # the caller's event loop is gone; nobody is listening any more
                self._forget(key)
                self.talker_loop.cancel(key)

    def _guarded(self, loop) -> None:
        """Run a stage loop; if it dies, every open stream fails with the reason instead of waiting forever."""
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            loop()
        except BaseException as exc:
            if isinstance(exc, Music3Error):  # a stop the stage names itself (say its worker died): one line
                log.error("engine stage stopped", extra={"stage": threading.current_thread().name, "error": str(exc)})
            else:
                log.exception("engine thread died")
            self._stop_serving(f"engine stage stopped ({threading.current_thread().name}): {error_text(exc)}")

    def _stop_serving(self, reason: str) -> None:
        """The engine cannot serve any more: every song it holds fails with the reason, and so does every submit."""
        with self._failing:  # the first reason stands (the stage-1 threads may both see a worker that is gone)
            self._broken = self._broken or reason
        for key in list(self._clients):
            self._fail(key, self._broken)

    # What the talker loop tells the songs' callers.
    def _live(self, key: str) -> bool:
        client = self._clients.get(key)
        return client is not None and not client.ended

    def _accepted(self, key: str, seed: int, budget: int, prompt_tokens: int) -> None:
        self._emit(key, Accepted, seed, budget, prompt_tokens)

    def _refused(self, key: str, message: str) -> None:
        if self._end(key) is not None:  # ends once: a cancel now is too late, and counts nothing
            self._emit(key, Failed, message, True)

    def _finished(self, event: SongFinished) -> None:
        client = self._clients.get(event.song)
        if client:
            client.finished = event

    # The watch: of the stage threads here for a call that never ends, and of stage 1's own needs (the worker).
    def _watch_loop(self) -> None:
        last = time.monotonic()
        # Once the engine is broken (say a stage thread died, mid-call: that is no hang) there is nothing left to watch.
        while not self._stop.wait(0.05) and self.stage1.loss is None and self._broken is None:
            now = time.monotonic()
            if now - last > PAUSE_S:  # this process was paused: that time counts for no call and no song's wait
                for watch in self.stage_watches.values():
                    watch.paused(now - last)
                self.stage1.paused()
            last = now
            for stage, watch in self.stage_watches.items():
                hung = watch.hung()
                if hung is not None:  # its thread cannot be stopped: the engine stops serving, /health says why
                    log.error("%s %s: the engine stops serving", stage, hung)
                    self._hung_stage = stage
                    self._stop_serving(f"{stage} {hung} and counts as hung; restart the engine's process")
                    return
            self.stage1.check()

    def _fail_and_cancel(self, key: str, message: str) -> None:
        """A song stage 1 cannot finish (its render failed, its audio was lost or late): it fails and is cancelled."""
        self._fail(key, message)
        self._cancel(key)  # stops its talker rows and drops its later windows

    def _on_chunk(self, out: RenderedWindow) -> None:
        self.metrics.windows.inc()
        now = time.perf_counter()
        client = self._clients.get(out.song)
        if client is None or client.ended:
            return
        client.windows += 1
        if not self.deploy.connector.extra.codec_streaming:  # the client gets the song in one piece at the end
            client.held_pcm.append(out.pcm.numpy())
            if not out.window.last:
                return
        if client.first_audio is None:
            client.first_audio = now
            self.metrics.first_audio.observe(now - client.submitted)
        if client.held_pcm:
            self._emit(out.song, AudioChunk, 0, np.concatenate(client.held_pcm, axis=-1), True)
        else:
            self._emit(out.song, AudioChunk, out.window.index, out.pcm.numpy(), out.window.last)
        if out.window.last:
            self._done(out.song, client, now)

    def _done(self, key: str, client: _Client, now: float) -> None:
        # The talker emits a song's last window in the step that emits its SongFinished, and TalkerLoop._hand_on takes
        # that first: `finished` was set before the window was handed on. Checked before the song ends, so that a
        # breach fails it.
        finished = client.finished
        assert finished is not None, f"{key}: its last window came before its SongFinished"
        if self._end(key) is None:  # cancelled or failed since its last window was taken
            return
        timings = {"first_audio_s": client.first_audio - client.submitted, "total_s": now - client.submitted}
        self.metrics.song_seconds.observe(timings["total_s"])
        self._emit(key, Done, finished.frames, finished.ended_by, timings)

    def _fail(self, key: str, message: str) -> None:
        """Fail a held submission (counted once, however many stages report it)."""
        if self._end(key) is None:
            return
        self.metrics.failures.inc()
        self._emit(key, Failed, _callers_ids(message))
