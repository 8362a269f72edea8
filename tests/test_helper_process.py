"""Helper processes: a job past its time limit is killed and the caller answered at once, a
runaway allocation fails in the helper (not the caller), a cancelled job is stopped, and a
killed helper is replaced within a second (the fork server)."""

from __future__ import annotations

import threading
import time

import pytest

from gateway.helper_process import HelperJobError, HelperLimitError, HelperPool
from tests.server import is_alive

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
GROW = ("{% set ns = namespace(s='xxxxxxxxxx') %}{% for i in range(40) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}")


@pytest.fixture(scope="module")
def pool():
    helpers = HelperPool("gateway.template_sandbox", size=2, memory_bytes=256 << 20,
                         name="test-template", preload=["gateway.template_sandbox"])
    assert helpers.run(["{{ 1 + 1 }}", {}, 100], 60) == "2"  # started
    yield helpers
    helpers.close()


def _wait_idle(pool, count=2, within_s=60.0):
    deadline = time.monotonic() + within_s
    while pool.num_idle() < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return pool.num_idle()


def test_a_job_past_its_time_limit_is_killed_and_answered_at_once(pool):
    _wait_idle(pool)
    before = set(pool.pids())
    started = time.monotonic()
    with pytest.raises(HelperLimitError) as caught:
        pool.run([LOOP, {}, 100], timeout_s=0.5)
    assert caught.value.limit == "time" and time.monotonic() - started < 1.5
    assert any(not is_alive(pid) for pid in before)
    replaced_at = time.monotonic()
    assert _wait_idle(pool) == 2
    print(f"replaced in {time.monotonic() - replaced_at:.2f} s")


def test_a_runaway_allocation_fails_in_the_helper(pool):
    with pytest.raises(HelperLimitError) as caught:
        pool.run([GROW, {}, 10 ** 12], timeout_s=60)
    assert caught.value.limit == "memory" and "256 MiB" in str(caught.value)
    assert pool.run(["ok", {}, 100], 60) == "ok"


def test_a_job_that_raises_leaves_its_helper_serving(pool):
    _wait_idle(pool)
    pids = set(pool.pids())
    with pytest.raises(HelperJobError) as caught:
        pool.run(["{{ raise_exception('no') }}", {}, 100], 5)
    assert caught.value.kind == "TemplateError" and str(caught.value) == "no"
    assert set(pool.pids()) == pids


def test_a_cancelled_job_is_stopped(pool):
    _wait_idle(pool)
    cancelled = threading.Event()
    threading.Timer(0.3, cancelled.set).start()
    started = time.monotonic()
    with pytest.raises(HelperLimitError) as caught:
        pool.run([LOOP, {}, 100], timeout_s=60, cancelled=cancelled)
    assert caught.value.limit == "cancelled" and time.monotonic() - started < 1.5


def test_closed_helpers_are_gone(pool):
    other = HelperPool("gateway.template_sandbox", size=1, name="test-close")
    assert other.run(["x", {}, 10], 60) == "x"
    pids = other.pids()
    other.close()
    assert pids and not any(is_alive(pid) for pid in pids)
