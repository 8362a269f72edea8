"""End to end: one real `gateway serve` with a broken plugin of every kind installed at once,
each its own distribution, all allowlisted, beside the healthy example plugins (summarize,
server_info, pip-installed):

- `import_fails`: an endpoint plugin whose module does not import;
- `factory_raises`: an endpoint plugin whose factory raises;
- `init_raises`: an endpoint plugin whose `init_state` raises (its route is taken out);
- `route_raises`: an endpoint plugin whose route handler raises at every request;
- `record_raises`: a stat logger whose `record()` raises at every engine step;
- `apply_raises`: a logits processor whose `apply()` raises when a request asks for it.

The server starts, serves the healthy plugins and the core routes, /v1/plugins names each
load failure with the process it happened in, a failing route or logits processor fails
only its requests (500, OpenAI-shaped, no traceback), the failing stat logger is logged
once per interval while the built-in ones keep counting, and the server exits cleanly.
"""

from __future__ import annotations

import re
import time

import pytest

from gateway.metrics.manager import DEFAULT_LOG_INTERVAL_S
from gateway.plugins import (
    ENDPOINT_PLUGINS_GROUP,
    LOGITS_PROCESSORS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
)
from tests.frontend.conftest import EXAMPLE_PLUGINS, SERVED_NAME, tiny_server
from tests.plugin_dists import write_dist
from tests.reliability.conftest import metric

pytestmark = pytest.mark.e2e

ROUTE_SOURCE = '''
from fastapi import APIRouter


class Plugin:
    def __init__(self, name, path, fail_init=False, crash=False):
        self.name, self.path, self.fail_init, self.crash = name, path, fail_init, crash
        self.required_tasks = None

    def attach_router(self, app):
        router = APIRouter()

        async def handler():
            if self.crash:
                raise RuntimeError("SECRET-ROUTE-DETAIL")
            return {"plugin": self.name}

        router.add_api_route(self.path, handler, methods=["GET"])
        app.include_router(router)

    async def init_state(self, engine_client, state, args):
        if self.fail_init:
            raise RuntimeError("init exploded")


def make():
    return Plugin(NAME, PATH, fail_init=FAIL_INIT, crash=CRASH)
'''

STAT_LOGGER_SOURCE = '''
from gateway.plugins import StatLoggerBase


class RecordRaises(StatLoggerBase):
    def record(self, scheduler_stats, iteration_stats, engine_idx=0):
        raise ValueError("record exploded")

    def log_engine_initialized(self):
        pass
'''

LOGITS_PROCESSOR_SOURCE = '''
from gateway.plugins.contracts import LogitsProcessor


class ApplyRaises(LogitsProcessor):
    """Raises in apply() while a request with extra_args {"explode": true} is in the batch."""

    def __init__(self, config, device, is_pin_memory):
        super().__init__(config, device, is_pin_memory)
        self.exploding = set()

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.exploding.discard(row)
        for row, params, _prompt, _output in batch_update.added:
            self.exploding.discard(row)
            if (params.extra_args or {}).get("explode"):
                self.exploding.add(row)
        for source, target, _direction in batch_update.moved:
            was_source, was_target = source in self.exploding, target in self.exploding
            self.exploding.discard(source)
            self.exploding.discard(target)
            if was_source:
                self.exploding.add(target)
            if was_target:
                self.exploding.add(source)

    def apply(self, logits):
        if self.exploding:
            raise RuntimeError("apply exploded")
        return logits
'''


def _route_plugin(name: str, path: str, *, fail_init: bool = False,
                  crash: bool = False) -> str:
    return (f"NAME, PATH, FAIL_INIT, CRASH = {name!r}, {path!r}, {fail_init}, {crash}\n"
            + ROUTE_SOURCE)


def write_broken_plugins(root):
    """Six distributions, one broken plugin each, into `root`."""
    write_dist(root, "gw-broken-import", {ENDPOINT_PLUGINS_GROUP: {
        "import_fails": "gw_broken_import:make"}},
        {"gw_broken_import": "import gw_no_such_module_anywhere\n"})
    write_dist(root, "gw-broken-factory", {ENDPOINT_PLUGINS_GROUP: {
        "factory_raises": "gw_broken_factory:make"}},
        {"gw_broken_factory": "def make():\n    raise RuntimeError('factory exploded')\n"})
    write_dist(root, "gw-broken-init", {ENDPOINT_PLUGINS_GROUP: {
        "init_raises": "gw_broken_init:make"}},
        {"gw_broken_init": _route_plugin("init_raises", "/v1/never-ready", fail_init=True)})
    write_dist(root, "gw-broken-route", {ENDPOINT_PLUGINS_GROUP: {
        "route_raises": "gw_broken_route:make"}},
        {"gw_broken_route": _route_plugin("route_raises", "/v1/always-fails", crash=True)})
    write_dist(root, "gw-broken-stats", {STAT_LOGGER_PLUGINS_GROUP: {
        "record_raises": "gw_broken_stats:RecordRaises"}},
        {"gw_broken_stats": STAT_LOGGER_SOURCE})
    write_dist(root, "gw-broken-lp", {LOGITS_PROCESSORS_GROUP: {
        "apply_raises": "gw_broken_lp:ApplyRaises"}},
        {"gw_broken_lp": LOGITS_PROCESSOR_SOURCE})
    return root


BROKEN = ["import_fails", "factory_raises", "init_raises", "route_raises", "record_raises",
          "apply_raises"]


@pytest.fixture(scope="module")
def server(tiny_model, example_plugins_site, tmp_path_factory):
    broken = write_broken_plugins(tmp_path_factory.mktemp("broken-plugins"))
    log = tmp_path_factory.mktemp("logs") / "broken-plugins-server.log"
    with tiny_server(tiny_model, roots=(broken, example_plugins_site), log_path=log,
                     VLLM_PLUGINS=",".join([*BROKEN, *EXAMPLE_PLUGINS])) as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()


@pytest.fixture(scope="module")
def records(http):
    return {(r["group"], r["name"]): r for r in http.get("/v1/plugins").json()["data"]}


def _generate(http, **extra):
    return http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4,
                                              "ignore_eos": True, **extra})


def test_healthy_plugins_and_core_routes_serve(http):
    assert http.get("/health").status_code == 200
    assert http.get("/v1/server-info").json()["engine"]["alive"] is True
    summary = http.post("/v1/summarize", json={"text": "A short text.", "max_tokens": 3})
    assert summary.status_code == 200, summary.text
    assert _generate(http).json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(("group", "name", "outcome", "role", "words"), [
    (ENDPOINT_PLUGINS_GROUP, "import_fails", "import-failed", "api-server",
     "gw_no_such_module_anywhere"),
    (ENDPOINT_PLUGINS_GROUP, "factory_raises", "factory-failed", "api-server",
     "factory exploded"),
    (ENDPOINT_PLUGINS_GROUP, "init_raises", "init-failed", "api-server", "init exploded"),
    (ENDPOINT_PLUGINS_GROUP, "route_raises", "attached", "api-server", None),
    (STAT_LOGGER_PLUGINS_GROUP, "record_raises", "loaded", "api-server", None),
    (LOGITS_PROCESSORS_GROUP, "apply_raises", "loaded", "engine-core", None),
    (ENDPOINT_PLUGINS_GROUP, "summarize", "attached", "api-server", None),
    (ENDPOINT_PLUGINS_GROUP, "server_info", "attached", "api-server", None),
])
def test_plugins_report_names_each_outcome_and_its_process(records, group, name, outcome,
                                                           role, words):
    record = records[(group, name)]
    assert (record["outcome"], record["process_role"]) == (outcome, role), record
    assert record["pid"] > 0 and record["distribution"]
    if words is None:
        assert not record["error"], record
    else:
        assert words in record["error"], record


def test_a_route_of_a_plugin_that_failed_init_is_not_served(http):
    assert http.get("/v1/never-ready").status_code == 404


def test_a_raising_route_fails_alone(server, http):
    for _ in range(3):
        response = http.get("/v1/always-fails")
        assert response.status_code == 500
        assert response.headers["x-request-id"] in response.json()["error"]["message"]
        assert "SECRET-ROUTE-DETAIL" not in response.text
    text = http.get("/metrics").text
    assert re.search(r'gateway_plugin_route_requests_total\{[^}]*plugin="route_raises"[^}]*'
                     r'status="500"[^}]*\} 3\.0', text), text
    assert http.get("/v1/server-info").status_code == 200


def test_a_raising_logits_processor_fails_its_request_and_the_server_goes_on(server, http):
    failed = _generate(http, vllm_xargs={"explode": True})
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["code"] == "engine_error" and "apply exploded" not in failed.text
    assert "apply exploded" in server.log_text()  # the operator sees why
    again = _generate(http)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["completion_tokens"] == 4
    assert http.get("/health").status_code == 200


def test_a_raising_stat_logger_is_logged_once_per_interval_and_others_still_count(server,
                                                                                   http):
    before = metric(http.get("/metrics").text, "vllm:generation_tokens_total", SERVED_NAME)
    started = time.monotonic()
    num_requests = 0
    while time.monotonic() - started < DEFAULT_LOG_INTERVAL_S + 1:
        assert _generate(http).status_code == 200
        num_requests += 1
    after = metric(http.get("/metrics").text, "vllm:generation_tokens_total", SERVED_NAME)
    assert after - before == 4 * num_requests  # the Prometheus logger still records
    log = server.log_text()
    tracebacks = log.count("Stat logger 'record_raises' raised in record()")
    intervals = (time.monotonic() - server.started_at) / DEFAULT_LOG_INTERVAL_S
    assert 1 <= tracebacks <= intervals + 1, (tracebacks, intervals)
    summaries = re.findall(r"Stat logger 'record_raises' raised (\d+) times", log)
    assert summaries and sum(map(int, summaries)) + tracebacks > tracebacks * 3, summaries


def test_plugins_report_counts_the_failures_while_serving(http):
    # After the tests above: the route failed 3 times, the stat logger at every step.
    records = {(r["group"], r["name"]): r for r in http.get("/v1/plugins").json()["data"]}
    route = records[(ENDPOINT_PLUGINS_GROUP, "route_raises")]
    assert route["outcome"] == "attached" and route["process_role"] == "api-server"
    assert route["num_runtime_errors"] == 3
    assert route["runtime_error"] == "GET /v1/always-fails answered 500"
    stats = records[(STAT_LOGGER_PLUGINS_GROUP, "record_raises")]
    assert stats["outcome"] == "loaded" and stats["process_role"] == "api-server"
    assert stats["num_runtime_errors"] > 3
    assert stats["runtime_error"] == "record(): ValueError: record exploded"
    healthy = records[(ENDPOINT_PLUGINS_GROUP, "summarize")]
    assert (healthy["num_runtime_errors"], healthy["runtime_error"]) == (0, None)
