"""An engine replica's Prometheus metrics copied into Ray's metrics export, where Ray Serve labels them with the
deployment, the replica and the application (Ray serves them on every node's metrics port as `ray_music3_*`)."""

from __future__ import annotations

import math
import threading
from typing import Any

from prometheus_client import CollectorRegistry
from ray.serve import metrics as serve_metrics

COPY_PERIOD_S = 5.0


class RayMetricsCopy:
    """Every COPY_PERIOD_S (and at close), each counter's increase, each gauge's value and each histogram bucket's new
    observations are handed to a Ray metric of the same name and labels. A histogram's new observations are counted
    in their bucket exactly; Ray's `_sum` adds each at its bucket's upper bound (past the last bound, twice it)."""

    def __init__(self, registry: CollectorRegistry, period_s: float = COPY_PERIOD_S) -> None:
        self.registry, self.period_s = registry, period_s
        self._metrics: dict[str, Any] = {}
        self._seen: dict[tuple, float] = {}  # (sample name, labels) -> the value last copied
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="music3-ray-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.copy()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period_s + 5)
        self.copy()

    def copy(self) -> None:
        for family in self.registry.collect():
            if family.type == "counter":
                self._counter(family)
            elif family.type == "gauge":
                for sample in family.samples:
                    self._metric(serve_metrics.Gauge, family, sample.labels).set(sample.value, tags=sample.labels)
            elif family.type == "histogram":
                self._histogram(family)

    def _metric(self, kind: type, family: Any, labels: dict, **kwargs: Any) -> Any:
        if family.name not in self._metrics:
            self._metrics[family.name] = kind(family.name, family.documentation, tag_keys=tuple(labels), **kwargs)
        return self._metrics[family.name]

    def _increase(self, name: str, labels: dict, value: float) -> float:
        key = (name, tuple(sorted(labels.items())))
        increase, self._seen[key] = value - self._seen.get(key, 0.0), value
        return increase

    def _counter(self, family: Any) -> None:
        for sample in family.samples:
            if sample.name.endswith("_total"):
                increase = self._increase(sample.name, sample.labels, sample.value)
                metric = self._metric(serve_metrics.Counter, family, sample.labels)
                if increase > 0:
                    metric.inc(increase, tags=sample.labels)

    def _histogram(self, family: Any) -> None:
        buckets = [s for s in family.samples if s.name.endswith("_bucket")]
        bounds = [float(s.labels["le"]) for s in buckets]
        finite = [b for b in bounds if math.isfinite(b)]
        labels = {k: v for k, v in buckets[0].labels.items() if k != "le"} if buckets else {}
        metric = self._metric(serve_metrics.Histogram, family, labels, boundaries=finite)
        below = 0.0
        for bound, sample in zip(bounds, buckets):  # cumulative counts: a bucket's own is the difference
            new = self._increase(sample.name, sample.labels, sample.value) - below
            below += new
            value = bound if math.isfinite(bound) else 2 * finite[-1]
            for _ in range(int(new)):
                metric.observe(value, tags=labels)
