"""The engine as a Python API: `submit(request)` streams events, `cancel(id)` stops a song.

The talker runs on a thread of this process with its own CUDA stream (serving/talker_loop.py); stage 1
(serving/stage1.py) is either a renderer on another thread and stream of this process (colocated: the talker keeps
writing frames while it renders) or a worker process (split). A watch thread catches a stage stuck in one call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from functools import partial
from pathlib import Path
from typing import AsyncIterator, Callable

import torch

from ..checkpoint import Music3Models, load_models
from ..errors import InputError, Music3Error
from ..prompt import encode_prompt, warn_dropped_lyrics
from .deploy_config import DeployConfig, load_deploy_config
from .deploy_schema import precision_log_level
from .engine_limits import MAX_SONGS, MAX_UNREAD_BYTES, audio_bytes, checked_request, too_long
from .engine_start import start_stages
from .events import Event, Failed, SongProgress, SongRequest
from .heartbeat import (
    RENDER_CALL, RENDER_LIMIT_PER_WINDOW_S, TALKER_CALL, TALKER_STEP_LIMIT_S, StageWatch, hang_limit,
)
from .held_songs import HeldSongs, SongClient
from .metrics import EngineMetrics
from .stage1 import LocalStage1, Stage1, WorkerStage1
from .stage_devices import stage_devices
from .stage_guard import StageGuard
from .stage_reports import StageReports
from .talker_loop import TalkerLoop
from .worker import RenderWorker
from .worker_process import load_acoustic

log = logging.getLogger(__name__)


class Engine:
    """Both stages behind one API. Its parts: the songs held for callers (`held`, held_songs.py), the stages'
    reports on them (`reports`, stage_reports.py) and the guard of the stage threads (`guard`, stage_guard.py)."""

    def __init__(self, models: Music3Models, deploy: DeployConfig | None = None, worker: RenderWorker | None = None):
        """Colocated: both stages here (models hold all five components). Split: stage 1 runs in `worker`."""
        deploy = deploy or load_deploy_config()
        self.deploy, self.models = deploy, models
        self.tokenizer = models.tokenizer
        self.device = models.language_model.embed.weight.device
        log.log(precision_log_level(deploy.stages[1].precision, self.device.type), "stage precision",
                extra=deploy.precisions(str(models.language_model.embed.weight.dtype).removeprefix("torch.")))
        stages = start_stages(models, deploy, colocated=worker is None)
        # Seconds from loaded weights to ready, per stage in this process (a worker's renderer gets ready in its own).
        self.talker, self.ready_s = stages.talker, stages.ready_s
        self.worker = worker  # (split) and self.renderer (colocated): for callers and tests; the engine uses stage1
        if worker is None:
            self.renderer = stages.renderer
        log.info("engine ready", extra={f"{part}_s": s for part, s in self.ready_s.items()})
        self.metrics = EngineMetrics(lambda: len(self.held), lambda: len(self.talker.waiting), self.unread_audio)
        # A song whose caller's loop is gone: its talker rows go (stage 1 drops its windows as the talker stops).
        self.held = HeldSongs(MAX_SONGS, MAX_UNREAD_BYTES, self.metrics, lambda key: self.talker_loop.cancel(key))
        self.reports = StageReports(self.held, deploy.connector.extra.codec_streaming, self.metrics, self._cancel)
        self._stop = threading.Event()
        self._closed = False
        # The stage threads of this process, watched for a call that never ends (the worker has its own watch).
        limit = partial(hang_limit, self.device.type)
        self.stage_watches = {"stage 0": StageWatch(limit(TALKER_STEP_LIMIT_S), TALKER_CALL)}
        if worker is None:
            self.stage_watches["stage 1"] = StageWatch(limit(RENDER_LIMIT_PER_WINDOW_S), RENDER_CALL)
            self.stage1: Stage1 = LocalStage1(self.renderer, self.reports.on_chunk, self.reports.fail_and_cancel,
                                              self._stop, self.stage_watches["stage 1"])
        else:
            self.stage1 = WorkerStage1(worker, self.device, self.reports.on_chunk, self.reports.fail_and_cancel,
                                       self._stop)
        self.talker_loop = TalkerLoop(self.talker, self.reports.callers(), self.stage1, self.stage_watches["stage 0"],
                                      self.metrics, self._stop, deploy.async_chunk)
        self.guard = StageGuard(self.device, self.stage_watches, self.stage1, self._stop, self.reports.fail_all)
        self._threads = [
            threading.Thread(target=self.guard.guarded, args=(loop,), name=name, daemon=True)
            for name, loop in (("music3-talker", self.talker_loop.run), ("music3-stage1", self.stage1.run),
                               ("music3-watch", self.guard.watch_loop))
        ]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # start-up work on the default stream is done before the stages run
        for thread in self._threads:
            thread.start()

    @classmethod
    def from_pretrained(
        cls, root: Path | str, deploy: DeployConfig | None = None, device: str | torch.device | None = None,
        split: bool | None = None, progress: bool = False,
    ) -> "Engine":
        """Stages whose `devices` differ run split (stage 1 in a worker process); `device` overrides both stages'
        devices (e.g. "cpu" for tests); `split` forces the placement either way. Without CUDA both stages run on the
        CPU in this process, whatever `devices` say. progress: bars while this process loads its weights."""
        deploy = deploy or load_deploy_config()
        s0, s1 = deploy.stages
        device0, device1 = stage_devices(deploy, device)
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
        default_seed = self.deploy.stages[0].default_sampling_params.seed
        song, budget_request, seed, steps = checked_request(request, default_seed)
        audio = audio_bytes(budget_request)
        if audio > self.max_unread_bytes:
            raise too_long(request.duration_s, audio, self.max_unread_bytes)
        client = SongClient(song, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter(), unread_bytes=audio)
        key = self.held.new_key(song)
        self.held.hold(key, client)
        if self._stop.is_set() or self.guard.broken:  # after registering: close() and a dying stage fail all they see
            self.held.forget(key)
            raise Music3Error(self.guard.broken or "the engine is closed; it takes no more songs")
        self.talker_loop.submit(key, cond, uncond, seed, budget_request, steps)
        try:
            warn_dropped_lyrics(request.lyrics, song=song)
            async for event in client.read(audio):
                yield event
        finally:
            if not client.read_to_end:  # the caller stopped reading before the end
                self.held.count_cancel(key)
            if client.done_s is not None:  # done, and not failed by its caller since
                self.metrics.song_seconds.observe(client.done_s)
            if self.held.forget(key):
                self._cancel(key)

    def cancel(self, song: str) -> bool:
        """Stop a song wherever it is; its stream ends with Failed("cancelled"), its rows and windows are freed.
        Whether it did: an id the engine does not hold, or whose song has ended (its Done or Failed is on its way to
        the caller), is ignored. A song is held from the first read of its stream (submit starts nothing until
        then): cancelling it earlier returns False; closing the unread stream is how to drop it."""
        if not isinstance(song, str):
            raise InputError(f"cancel takes a song's id (a string), got {type(song).__name__}: {song!r:.80}")
        return self._end(song, self.held.count_cancel)

    def fail(self, song: str, message: str) -> bool:
        """End a song as failed for a reason of the caller's (say the server could not encode its audio), as cancel
        does but counted as a failure: its stream ends with Failed(message). A song whose Done is out but whose stream
        is still open is counted as failed instead of done. Whether it did, as for cancel."""
        if self._end(song, partial(self.reports.fail, message=message)):
            return True
        key = self.held.key_of(song)
        return key is not None and self.reports.fail_done(key)

    def _end(self, song: str, end: Callable[[str], bool]) -> bool:
        """End the song held as `song` if end(key) does: its id free at once, its work stopped in both stages."""
        key = self.held.key_of(song)
        if key is None or not end(key):
            return False
        self.held.release_id(song, key)
        self._cancel(key)
        return True

    def progress(self, song: str) -> SongProgress | None:
        """The progress of the song held under the caller's id `song` (each count may be a step behind), or None.
        A song whose last frame is written reports its final count; one cancelled or failed, 0 frames or None."""
        key = self.held.key_of(song)
        client = self.held.client(key) if key is not None else None
        if client is None:
            return None
        finished, decoding = client.finished, self.talker.songs.get(key)
        frames = finished.frames if finished is not None else decoding.frames if decoding is not None else 0
        # Queued: waiting for the talker to take it (before it does, or in its queue); never again once it has rows.
        waiting = not client.accepted if decoding is None else decoding.pair is None
        return SongProgress(frames, client.windows, finished is None and waiting)

    @property
    def max_songs(self) -> int:
        """Songs held at once (HeldSongs keeps it; the server lowers it to its file limit)."""
        return self.held.max_songs

    @max_songs.setter
    def max_songs(self, songs: int) -> None:
        self.held.max_songs = songs

    @property
    def max_unread_bytes(self) -> int:
        """Audio held for callers that have not read it yet, in bytes."""
        return self.held.max_unread_bytes

    @max_unread_bytes.setter
    def max_unread_bytes(self, nbytes: int) -> None:
        self.held.max_unread_bytes = nbytes

    def hold_read_audio(self, nbytes: int) -> None:
        """HeldSongs.hold_read_audio: audio a caller has read but still holds counts toward max_unread_bytes."""
        self.held.hold_read_audio(nbytes)

    def unread_audio(self) -> int:
        """Bytes of audio held for callers (HeldSongs.unread_audio)."""
        return self.held.unread_audio()

    def unavailable(self) -> str | None:
        """Why the engine takes no songs (closed, or a stage died), or None while it serves."""
        if self.guard.broken:
            return self.guard.broken
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
        for key in self.held.held_keys():
            self.held.emit(key, Failed, "engine closed")
        self.talker_loop.wake()
        self.stage1.stop()
        talker, stage1, watch = self._threads
        # A thread the watch found stuck is not waited for (it may never return; it is a daemon).
        stuck = {"stage 0": talker, "stage 1": stage1}.get(self.guard.hung_stage)
        talker.join(timeout=0 if talker is stuck else 30)
        self.stage1.close()
        for thread in (stage1, watch):
            thread.join(timeout=0 if thread is stuck else 30)

    def _cancel(self, key: str) -> None:
        """Stop a song's work in both stages; its stream, if still open, gets Failed("cancelled")."""
        self.talker_loop.cancel(key)  # first: a retry under the same id is a new key anyway
        self.stage1.drop_waits(key)  # now; again once the talker has stopped sending the song's windows
        self.held.emit(key, Failed, "cancelled")
