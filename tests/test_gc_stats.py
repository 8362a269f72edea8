"""gateway/gc_stats.py: a spawned process's garbage-collector counts reach its parent."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

from gateway import gc_stats

CHILD = """
import gc, os
from gateway import gc_stats
gc_stats.publish()
for _ in range(3):
    gc.collect()
print(os.getpid())
"""


def test_a_child_publishes_its_counts_after_each_collection(tmp_path: Path) -> None:
    env = {**os.environ, gc_stats.ENV_VAR: str(tmp_path)}
    child = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                           text=True, timeout=60, check=True)
    elsewhere = tmp_path / "another-engine"
    elsewhere.mkdir()
    # Found in whichever folder holds it (data parallel: one folder per engine).
    counts = gc_stats.read([str(elsewhere), str(tmp_path)], int(child.stdout))
    assert counts is not None and len(counts) == gc_stats.NUM_GENERATIONS
    assert counts[2]["collections"] >= 3  # each gc.collect() is a full collection


def test_unknown_processes_have_no_counts_and_this_one_reads_gc_itself(tmp_path: Path) -> None:
    assert gc_stats.read([str(tmp_path)], 1) is None
    assert gc_stats.read([], 1) is None
    gc.collect()
    ours = gc_stats.read([], os.getpid())
    assert ours is not None and ours[2]["collections"] == gc.get_stats()[2]["collections"]


def test_the_folder_is_named_only_to_children_spawned_inside_the_block(tmp_path: Path) -> None:
    before = os.environ.get(gc_stats.ENV_VAR)
    with gc_stats.shared_with_children(str(tmp_path)):
        assert os.environ[gc_stats.ENV_VAR] == str(tmp_path)
    assert os.environ.get(gc_stats.ENV_VAR) == before
