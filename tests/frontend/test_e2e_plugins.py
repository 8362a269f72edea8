"""End to end: endpoint plugins on a real `gateway serve` (tiny model): the VLLM_PLUGINS
matrix, isolation of each broken plugin, route replacement and conflicts, auth on core and
plugin routes, the merged load report, and the example plugins pip-installed from
endpoint_plugins/ as a user would. The unset case is in test_e2e_openai.py.
"""

from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import pytest

from gateway.plugins import ENDPOINT_PLUGINS_GROUP, GENERAL_PLUGINS_GROUP
from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.frontend.fake_endpoints import GENERAL_NAME

pytestmark = pytest.mark.e2e

KEY = "sk-e2e-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENABLED = ["hello", "needs_embed", "factory_raises", "not_a_plugin", "attach_raises",
           "init_raises", "replaces_models", "crashes", "summarize", "server_info", "dedupe",
           GENERAL_NAME]
FAILED = {"factory-failed", "invalid-plugin", "attach-failed", "init-failed"}


@pytest.fixture(scope="module")
def server(tiny_model, fake_endpoints_site, example_plugins_site, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "plugins-server.log"
    with tiny_server(tiny_model, "--api-key", KEY,
                     roots=(fake_endpoints_site, example_plugins_site), log_path=log,
                     VLLM_PLUGINS=",".join(ENABLED)) as server:
        yield server


@pytest.fixture(scope="module")
def records(http):
    return http.get("/v1/plugins", headers=AUTH).json()["data"]


def _endpoint(records, name):
    (record,) = [r for r in records if (r["group"], r["name"]) == (ENDPOINT_PLUGINS_GROUP,
                                                                    name)]
    return record


# ------------------------------------------------------------------ allowlist and isolation
def test_named_plugins_serve_their_routes(http):
    assert http.get("/v1/hello", headers=AUTH).json() == {"plugin": "hello-plugin"}


@pytest.mark.parametrize(("name", "outcome"), [
    ("hello", "attached"), ("summarize", "attached"), ("server_info", "attached"),
    ("replaces_models", "attached"), ("crashes", "attached"),
    ("needs_embed", "skipped-tasks"), ("dedupe", "skipped-tasks"),
    ("factory_raises", "factory-failed"),
    ("not_a_plugin", "invalid-plugin"), ("attach_raises", "attach-failed"),
    ("init_raises", "init-failed"), ("replaces_detokenize", "not-allowlisted"),
])
def test_each_plugin_has_its_outcome_in_the_report(records, name, outcome):
    record = _endpoint(records, name)
    assert record["outcome"] == outcome
    assert record["process_role"] == "api-server" and record["pid"] > 0
    assert bool(record["error"]) == (outcome in FAILED)


def test_report_merges_the_records_of_every_process(server, records):
    general = [r for r in records if (r["group"], r["name"]) == (GENERAL_PLUGINS_GROUP,
                                                                  GENERAL_NAME)]
    roles = {r["process_role"]: r for r in general}
    assert roles["api-server"]["pid"] == server.process.pid
    engine_side = [r for role, r in roles.items() if role != "api-server"]
    assert engine_side, general  # the engine core (and any worker) called it too
    assert all(r["outcome"] == "called" and r["pid"] != server.process.pid
               for r in engine_side)


@pytest.mark.parametrize("path", ["/v1/half-attached", "/v1/init-broken", "/v1/embed-thing",
                                  "/v1/dedupe"])
def test_routes_of_skipped_plugins_are_not_served(http, path):
    assert http.get(path, headers=AUTH).status_code == 404


@pytest.mark.parametrize("name", ["needs_embed", "dedupe"])
def test_gated_plugin_is_logged_with_both_task_lists(server, name):
    line = next(line for line in server.log_text().splitlines()
                if f"'{name}' skipped" in line)
    assert "['embed']" in line and "['generate']" in line


def test_plugin_route_replaces_the_core_route(server, http):
    assert http.get("/v1/models", headers=AUTH).json() == {"plugin": "replaces_models"}
    assert "replaces the core route GET /v1/models" in server.log_text()


def test_failing_plugin_handler_is_a_500_and_the_server_keeps_serving(http):
    response = http.get("/v1/crash", headers={**AUTH, "X-Request-Id": "crash-1"})
    assert response.status_code == 500
    assert "crash-1" in response.json()["error"]["message"]
    assert "SECRET-TRACEBACK-DETAIL" not in response.text
    assert http.get("/v1/hello", headers=AUTH).status_code == 200


# ------------------------------------------------------------------ auth
@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/hello"), ("GET", "/v1/server-info"), ("POST", "/v1/summarize"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/plugins"),
    ("POST", "/tokenize"),
])
def test_core_and_plugin_routes_need_the_key(http, method, path):
    response = http.request(method, path, json={})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert KEY not in response.text


@pytest.mark.parametrize("path", ["/health", "/ping", "/version", "/metrics"])
def test_public_routes_need_no_key(http, path):
    assert http.get(path).status_code == 200


def test_the_key_opens_generation(http):
    response = http.post("/v1/completions", headers=AUTH,
                         json={"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200


# ------------------------------------------------------------------ the example plugins
def test_summarize_plugin_generates_through_the_engine(http):
    response = http.post("/v1/summarize", headers=AUTH,
                         json={"text": "The quick brown fox jumps over the lazy dog.",
                               "max_tokens": 8})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == SERVED_NAME and isinstance(body["summary"], str)
    assert 1 <= body["usage"]["completion_tokens"] <= 8


def test_summarize_plugin_refuses_a_text_longer_than_the_context(http):
    response = http.post("/v1/summarize", headers=AUTH,
                         json={"text": "word " * 3000, "max_tokens": 8})
    assert response.status_code == 400
    assert "context" in response.json()["error"]["message"]


def test_server_info_plugin_describes_the_server(http):
    info = http.get("/v1/server-info", headers=AUTH).json()
    assert info["model"] == SERVED_NAME and info["supported_tasks"] == ["generate"]
    assert info["engine"]["alive"] is True and info["max_model_len"] == 2048
    assert "summarize" in info["plugins"]["attached_endpoints"]


# ------------------------------------------------------------------ client disconnects
LONG = 2000  # tokens: far more than generate in the time these tests wait


def _engine_state(http):
    return http.get("/v1/server-info", headers=AUTH).json()["engine"]


def _wait_for(http, condition, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _engine_state(http)
        if condition(state):
            return state
        time.sleep(0.1)
    raise AssertionError(f"not reached in {timeout_s} s: {state}")


def _aborted(http) -> float:
    """vllm:request_success_total for finished_reason="abort", from /metrics."""
    for line in http.get("/metrics", headers=AUTH).text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort series in /metrics")


def _assert_aborted(http, aborted_before: float):
    # The front end stops iterating at once (which aborts the request in the engine) ...
    _wait_for(http, lambda s: s["num_inflight_requests"] == 0, 10)
    # ... and the engine then drops it, before its LONG tokens: it ends as aborted, not
    # by its length (which a fast machine could reach if the abort were lost).
    _wait_for(http, lambda s: s["scheduler"]["num_running_reqs"] == 0, 30)
    assert _aborted(http) == aborted_before + 1


def test_client_leaving_a_stream_aborts_its_request(server, http):
    body = {"prompt": "x", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    aborted = _aborted(http)
    with httpx.Client(base_url=server.url(), headers=AUTH, timeout=60) as other, \
            other.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert _engine_state(http)["num_inflight_requests"] == 1
    _assert_aborted(http, aborted)


def test_client_leaving_a_non_streaming_request_aborts_it(server, http):
    body = json.dumps({"prompt": "x", "max_tokens": LONG, "ignore_eos": True}).encode()
    aborted = _aborted(http)
    url = httpx.URL(server.url())
    # A raw connection, closed as soon as the engine runs the request: however fast the
    # machine generates, the client leaves while the answer is being made.
    with socket.create_connection((url.host, url.port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                       b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                       b"Content-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        _wait_for(http, lambda s: s["scheduler"]["num_running_reqs"] == 1, 10)
    _assert_aborted(http, aborted)


# ------------------------------------------------------------------ one server each
@pytest.mark.parametrize(("sig", "to_group"), [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["sigterm-to-server", "ctrl-c-to-group"])
def test_empty_allowlist_serves_no_plugin_and_a_stop_signal_leaves_no_child(
        tiny_model, fake_endpoints_site, tmp_path, sig, to_group):
    with tiny_server(tiny_model, roots=(fake_endpoints_site,), VLLM_PLUGINS="",
                     log_path=tmp_path / "server.log") as server:
        assert httpx.get(server.url("/v1/hello")).status_code == 404
        assert "VLLM_PLUGINS is unset" not in server.log_text()
        exit_code = server.stop(sig, to_group=to_group)
    assert exit_code == 0, server.log_tail()
    assert not server.leftover_pids
    # The engine must stop when asked, also when it got the signal too (Ctrl-C).
    assert "did not shut down" not in server.log_text(), server.log_tail()


def test_two_plugins_on_one_route_stop_start_up_naming_both(tiny_model, fake_endpoints_site,
                                                            tmp_path):
    server = tiny_server(tiny_model, roots=(fake_endpoints_site,),
                         VLLM_PLUGINS="twin_a,twin_b", log_path=tmp_path / "server.log")
    with pytest.raises(RuntimeError, match="exited with 1"):
        server.start()
    log = server.log_text()
    assert "'twin_a'" in log and "'twin_b'" in log and "GET /v1/twin" in log
    assert not server.leftover_pids
