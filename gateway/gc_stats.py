"""The garbage collector's counts of every server process, for the front end's
`python_gc_*` metrics (any process).

prometheus_client's GC collector sees only the process that renders /metrics. So each
process the front end spawns (the engine core, each local worker) keeps its
`gc.get_stats()` in a small file of its own, `gc-<pid>.bin` in the folder named by
GATEWAY_GC_STATS_DIR (set by the front end for its children only), rewritten by a `gc`
callback after each collection: 3 generations x (collections, collected, uncollectable)
as float64. The front end reads the file of each pid at scrape time.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENV_VAR = "GATEWAY_GC_STATS_DIR"
FIELDS = ("collections", "collected", "uncollectable")
NUM_GENERATIONS = 3
_LAYOUT = struct.Struct(f"<{NUM_GENERATIONS * len(FIELDS)}d")

_published: mmap.mmap | None = None  # this process's file, kept open while it lives


def stats_path(folder: str, pid: int) -> Path:
    return Path(folder) / f"gc-{pid}.bin"


@contextlib.contextmanager
def shared_with_children(folder: str) -> Iterator[None]:
    """While this block runs, processes spawned here (and their own children) publish
    their counts into `folder`."""
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = folder
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before


def publish() -> None:
    """Keep this process's counts in its file, when a spawning parent asked for them."""
    global _published
    folder = os.environ.get(ENV_VAR)
    if not folder or _published is not None:
        return
    try:
        with open(stats_path(folder, os.getpid()), "w+b") as file:
            file.truncate(_LAYOUT.size)
            _published = mmap.mmap(file.fileno(), _LAYOUT.size)
    except OSError:
        return  # the folder is gone: the parent is shutting down
    _write()
    gc.callbacks.append(_after_collection)


def _after_collection(phase: str, info: dict[str, Any]) -> None:
    if phase == "stop":
        _write()


def _write() -> None:
    if _published is not None:
        values = [float(stats[field]) for stats in gc.get_stats() for field in FIELDS]
        _LAYOUT.pack_into(_published, 0, *values[:_LAYOUT.size // 8])


def read(folders: list[str], pid: int) -> list[dict[str, float]] | None:
    """The counts of `pid` by generation (this process: read directly), from the first of
    `folders` that holds its file; None if unknown."""
    if pid == os.getpid():
        return [{field: float(stats[field]) for field in FIELDS} for stats in gc.get_stats()]
    for folder in folders:
        try:
            values = _LAYOUT.unpack(stats_path(folder, pid).read_bytes()[:_LAYOUT.size])
            break
        except (OSError, struct.error):
            continue
    else:
        return None
    width = len(FIELDS)
    return [dict(zip(FIELDS, values[g * width:(g + 1) * width]))
            for g in range(NUM_GENERATIONS)]
