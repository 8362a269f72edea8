"""This process's plugin state is one object made at the process's start (issue 13, item 3)."""

from __future__ import annotations

from gateway.plugins import (
    DEFAULT_PLUGINS_GROUP,
    load_report,
    reset_for_tests,
    start_process,
    this_process,
)
from tests.conftest import run_python


def test_start_process_names_the_process_and_keeps_what_was_recorded():
    load_report().record(DEFAULT_PLUGINS_GROUP, "early", "m:f", "dist", "loaded")
    state = start_process("engine-core")
    assert state is this_process() and state.role == "engine-core"
    assert load_report() is state.report
    assert load_report().get(DEFAULT_PLUGINS_GROUP, "early") is not None
    load_report().record(DEFAULT_PLUGINS_GROUP, "later", "m:f", "dist", "called")
    assert load_report().get(DEFAULT_PLUGINS_GROUP, "later").process_role == "engine-core"


def test_the_reset_for_tests_gives_a_fresh_state():
    start_process("worker-3")
    load_report().record(DEFAULT_PLUGINS_GROUP, "x", "m:f", "dist", "loaded")
    reset_for_tests()
    assert this_process().role == "main" and load_report().records() == []
    assert not this_process().general_plugins_loaded


def test_a_spawned_process_takes_its_role_from_the_environment():
    proc = run_python("from gateway.plugins import this_process\nprint(this_process().role)",
                      GATEWAY_PROCESS_ROLE="worker-1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "worker-1"
