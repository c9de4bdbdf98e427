"""Prometheus metrics of one engine (its own registry, so several engines in a process never collide)."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from ..errors import EngineBusy, InputError, Music3Error

LATENCY_BUCKETS = (0.25, 0.5, 1, 1.5, 2, 3, 5, 8, 13, 21, 34, 60, 120, 300)


REFUSALS = ("invalid", "busy", "unavailable")  # bad input (HTTP 400), at max songs (429), closed or broken (503)


class EngineMetrics:
    def __init__(self, songs_held: Callable[[], int], songs_waiting: Callable[[], int],
                 unread_audio: Callable[[], int]) -> None:
        """songs_held / songs_waiting / unread_audio: read at each scrape (all songs the engine holds; those not yet
        decoding; the bytes of audio held for callers that have not read or sent it)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("music3_requests", "Songs accepted (each given its frame budget)", registry=r)
        self.failures = Counter("music3_failures", "Songs that ended with an error", registry=r)
        self.refusals = Counter("music3_refusals", "Submissions refused before acceptance", ["reason"], registry=r)
        for reason in REFUSALS:  # every series exported from the start, at zero
            self.refusals.labels(reason)
        self.cancels = Counter("music3_cancels", "Songs cancelled by their caller (or a client gone)", registry=r)
        Gauge("music3_songs_held", "Songs the engine holds (decoding, waiting or rendering)",
              registry=r).set_function(songs_held)
        Gauge("music3_songs_waiting", "Songs waiting for talker rows", registry=r).set_function(songs_waiting)
        Gauge("music3_unread_audio_bytes", "Audio held for callers: songs' audio not read yet, and audio read but not "
              "sent (whole songs)", registry=r).set_function(unread_audio)
        self.talker_steps = Counter("music3_talker_steps", "Stage-0 scheduler steps", registry=r)
        self.frames = Counter("music3_frames", "Frames (40 ms each) written by stage 0", registry=r)
        self.windows = Counter("music3_windows", "Windows rendered by stage 1", registry=r)
        self.first_audio = Histogram(
            "music3_first_audio_seconds", "Submit to first PCM chunk", buckets=LATENCY_BUCKETS, registry=r
        )
        self.song_seconds = Histogram(
            "music3_song_seconds", "Submit to last PCM chunk", buckets=LATENCY_BUCKETS, registry=r
        )

    async def counting_refusals(self, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """A song's `events`, with the Music3Error that refuses it counted by its reason; closing this closes them at
        once."""
        try:
            async with contextlib.aclosing(events) as stream:  # type: ignore[type-var]
                async for event in stream:
                    yield event
        except Music3Error as exc:
            refused = "invalid" if isinstance(exc, InputError) else "busy" if isinstance(exc, EngineBusy) else None
            self.refusals.labels(refused or "unavailable").inc()
            raise

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric, without prometheus_client's `*_created` series (a creation
        timestamp per counter and histogram: as many series again, for nothing a scrape needs)."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A registry's metrics with their `*_created` samples left out."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
