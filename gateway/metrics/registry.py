"""Where the front end's metrics live: one pair of Prometheus registries per app.

Never the global default registry (STYLE 14): two apps in one process (tests) or a stat
logger made twice would collide there. In one process, metrics are declared in a registry
and /metrics renders that same registry. With PROMETHEUS_MULTIPROC_DIR set, prometheus_client
keeps each value in a file of that folder; metrics are then declared in a registry nobody
renders, and /metrics renders a MultiProcessCollector that sums the files of every process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from gateway import envs

_KINDS: dict[str, Any] = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


@dataclass(frozen=True)
class MetricSpec:
    """One metric, as data: its exposed name, kind, help, buckets (histograms) and the
    labels it adds to the common ones. `multiprocess_mode` says how gauges of several
    processes combine (prometheus_client's modes); counters and histograms sum."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    buckets: tuple[float, ...] = ()
    labels: tuple[str, ...] = ()
    multiprocess_mode: str = "mostrecent"


@dataclass
class MetricsRegistries:
    """`registry`: where metric objects are declared. `exposition`: what /metrics renders
    (the same registry, or a multiprocess collector over the files)."""

    registry: CollectorRegistry
    exposition: CollectorRegistry
    multiprocess_dir: str | None = None
    _declared: dict[str, Any] = field(default_factory=dict)

    def declare(self, specs: tuple[MetricSpec, ...], common_labels: tuple[str, ...] = (),
                ) -> dict[str, Any]:
        """Declare each spec once (one loop over the table); return {name: metric}.

        Declaring a name twice returns the first metric, so two stat loggers of one app may
        share a table."""
        return {spec.name: self._declare(spec, common_labels) for spec in specs}

    def _declare(self, spec: MetricSpec, common_labels: tuple[str, ...]) -> Any:
        if spec.name not in self._declared:
            kwargs: dict[str, Any] = {"labelnames": (*common_labels, *spec.labels),
                                      "registry": self.registry}
            if spec.kind == "histogram":
                kwargs["buckets"] = spec.buckets
            if spec.kind == "gauge":
                kwargs["multiprocess_mode"] = spec.multiprocess_mode
            self._declared[spec.name] = _KINDS[spec.kind](spec.name, spec.help, **kwargs)
        return self._declared[spec.name]


def make_registries() -> MetricsRegistries:
    """A fresh pair for one app; multiprocess when PROMETHEUS_MULTIPROC_DIR is set."""
    folder = envs.prometheus_multiproc_dir()
    if folder is None:
        registry = CollectorRegistry()
        return MetricsRegistries(registry, registry)
    exposition = CollectorRegistry()
    multiprocess.MultiProcessCollector(exposition, path=folder)
    return MetricsRegistries(CollectorRegistry(), exposition, folder)
