"""`process_*` and `python_gc_*` metrics for every process of the server, read at each
scrape (`process_*` from /proc; `python_gc_*` as gateway/gc_stats.py keeps them).

Front-end process. prometheus_client's own process collector sees only the process that
renders /metrics; an operator wants the engine core and each worker too (a worker's memory
is most of the server's). So one collector reads `/proc/<pid>` of each local process the
engine reported at its handshake, and labels each series with the process's role
(`api-server`, `engine-core`, `worker-<rank>`). A process that is gone is left out. On a
system without /proc (not Linux) nothing is exported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway import gc_stats

ProcessSource = Callable[[], dict[str, int]]  # role -> pid

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_SIZE = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096


def _boot_time() -> float:
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def read_process(pid: int) -> dict[str, float] | None:
    """cpu seconds, resident and virtual bytes, start time, open and max fds of `pid`."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
        fields = stat[stat.rindex(")") + 2:].split()
        num_fds = len(os.listdir(f"/proc/{pid}/fd"))
        max_fds = _max_open_files(pid)
    except (OSError, ValueError):
        return None
    # Fields after "(comm)": state is [0], utime [11], stime [12], starttime [19],
    # vsize [20], rss (pages) [21].
    return {
        "cpu": (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS,
        "resident": int(fields[21]) * _PAGE_SIZE,
        "virtual": float(fields[20]),
        "start": _BOOT_TIME + int(fields[19]) / _CLOCK_TICKS,
        "open_fds": float(num_fds),
        "max_fds": max_fds,
    }


def _max_open_files(pid: int) -> float:
    with open(f"/proc/{pid}/limits") as limits:
        for line in limits:
            if line.startswith("Max open files"):
                soft = line.split()[3]
                return float("inf") if soft == "unlimited" else float(soft)
    return float("nan")


_BOOT_TIME = _boot_time()
_FAMILIES = (
    ("process_cpu_seconds_total", "counter", "cpu",
     "Total user and system CPU time spent in seconds."),
    ("process_resident_memory_bytes", "gauge", "resident", "Resident memory size in bytes."),
    ("process_virtual_memory_bytes", "gauge", "virtual", "Virtual memory size in bytes."),
    ("process_start_time_seconds", "gauge", "start",
     "Start time of the process since unix epoch in seconds."),
    ("process_open_fds", "gauge", "open_fds", "Number of open file descriptors."),
    ("process_max_fds", "gauge", "max_fds", "Maximum number of open file descriptors."),
)


class ServerProcessCollector(Collector):
    """The `process_*` families with a `process` label, one series per server process."""

    def __init__(self, source: ProcessSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        readings = {role: read_process(pid) for role, pid in self.source().items()}
        for name, kind, key, help_text in _FAMILIES:
            family_cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_cls(name.removesuffix("_total"), help_text, labels=["process"])
            for role, reading in readings.items():
                if reading is not None:
                    family.add_metric([role], reading[key])
            yield family


#: prometheus_client's `python_gc_*` families: (name, the gc_stats field, help).
_GC_FAMILIES = (
    ("python_gc_objects_collected", "collected", "Objects collected during gc"),
    ("python_gc_objects_uncollectable", "uncollectable", "Uncollectable objects found during GC"),
    ("python_gc_collections", "collections", "Number of times this generation was collected"),
)


class ServerGcCollector(Collector):
    """prometheus_client's `python_gc_*` counters with a `process` label: this process's
    from `gc` itself, the spawned ones' from the files they keep (gateway/gc_stats.py)."""

    def __init__(self, source: ProcessSource, folders: Callable[[], list[str]]) -> None:
        self.source = source
        self.folders = folders  # where the spawned processes keep their files

    def collect(self) -> Iterator[Any]:
        folders = self.folders()
        readings = {role: gc_stats.read(folders, pid) for role, pid in self.source().items()}
        for name, field, help_text in _GC_FAMILIES:
            family = CounterMetricFamily(name, help_text, labels=["generation", "process"])
            for role, generations in readings.items():
                for generation, stats in enumerate(generations or ()):
                    family.add_metric([str(generation), role], stats[field])
            yield family
