"""Endpoint plugins on the app: the allowlist, task gating, route conflicts and isolation
(DESIGN section 3, rules 3 and 5, and "Beyond the reference"), in process.

The app is built by the real `build_app` from plugins found through real entry points; no
request here reaches the engine. The same rules run against the real server in
test_e2e_plugins.py.
"""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from gateway.frontend.app import build_app
from gateway.plugins import ENDPOINT_PLUGINS_GROUP, PluginError, load_report
from tests.frontend.conftest import EngineInfo, serve_config

pytestmark = pytest.mark.usefixtures("fake_endpoints")


def _outcomes() -> dict[str, str]:
    return {r.name: r.outcome for r in load_report().records(ENDPOINT_PLUGINS_GROUP)}


def _client(monkeypatch, allowlist: str | None, *argv: str, **engine) -> TestClient:
    if allowlist is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allowlist)
    return TestClient(build_app(serve_config(*argv), EngineInfo(**engine)))


def test_unset_allowlist_loads_no_endpoint_plugin_and_warns_naming_them(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING), _client(monkeypatch, None) as client:
        assert client.get("/v1/hello").status_code == 404
    warning = next(r.getMessage() for r in caplog.records if "VLLM_PLUGINS is unset" in
                   r.getMessage())
    assert "hello (gw-test-endpoints)" in warning and "crashes (gw-test-endpoints)" in warning
    assert set(_outcomes().values()) == {"not-allowlisted"}


def test_empty_allowlist_loads_none_without_the_unset_warning(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING), _client(monkeypatch, "") as client:
        assert client.get("/v1/hello").status_code == 404
    assert not any("VLLM_PLUGINS is unset" in r.getMessage() for r in caplog.records)


def test_named_plugin_serves_its_route_and_is_recorded_attached(monkeypatch):
    with _client(monkeypatch, "hello") as client:
        response = client.get("/v1/hello")
        assert (response.status_code, response.json()) == (200, {"plugin": "hello-plugin"})
        assert client.app.state.hello_plugin_ready is True  # init_state got the engine
    record = load_report().get(ENDPOINT_PLUGINS_GROUP, "hello")
    assert record.outcome == "attached" and "GET /v1/hello" in record.detail
    assert _outcomes()["crashes"] == "not-allowlisted"


def test_plugin_gated_by_tasks_is_skipped_with_both_task_lists(monkeypatch, caplog):
    with caplog.at_level(logging.INFO), _client(monkeypatch, "needs_embed,hello") as client:
        assert client.get("/v1/embed-thing").status_code == 404
        assert client.get("/v1/hello").status_code == 200
    record = load_report().get(ENDPOINT_PLUGINS_GROUP, "needs_embed")
    assert record.outcome == "skipped-tasks"
    assert "['embed']" in record.detail and "['generate']" in record.detail
    assert any("needs_embed" in r.getMessage() and "skipped" in r.getMessage()
               for r in caplog.records)


def test_plugin_route_replaces_the_core_route_with_a_warning(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING), _client(monkeypatch, "replaces_models") as client:
        assert client.get("/v1/models").json() == {"plugin": "replaces_models"}
        operation = client.get("/openapi.json").json()["paths"]["/v1/models"]["get"]
        assert operation["summary"] == "plugin replaces_models"
    assert any("replaces the core route GET /v1/models" in r.getMessage()
               for r in caplog.records)
    assert "replaces core GET /v1/models" in load_report().get(ENDPOINT_PLUGINS_GROUP,
                                                        "replaces_models").detail


def test_two_plugins_on_one_path_and_method_stop_start_up_naming_both(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "twin_a,twin_b")
    with pytest.raises(PluginError) as excinfo:
        build_app(serve_config(), EngineInfo())
    message = str(excinfo.value)
    assert "'twin_a'" in message and "'twin_b'" in message and "GET /v1/twin" in message
    assert "gw-test-endpoints" in message


ISOLATED = {
    "factory_raises": "factory-failed",
    "not_a_plugin": "invalid-plugin",
    "attach_raises": "attach-failed",
    "init_raises": "init-failed",
}


@pytest.mark.parametrize("broken", sorted(ISOLATED))
def test_a_broken_plugin_is_skipped_alone(monkeypatch, broken):
    with _client(monkeypatch, f"{broken},hello") as client:
        assert client.get("/v1/hello").status_code == 200
        records = {r["name"]: r for r in client.get("/v1/plugins").json()["data"]
                   if r["group"] == ENDPOINT_PLUGINS_GROUP}
    assert records[broken]["outcome"] == ISOLATED[broken]
    assert records[broken]["error"]
    assert records["hello"]["outcome"] == "attached"


@pytest.mark.parametrize("path", ["/v1/half-attached", "/v1/init-broken"])
def test_routes_of_a_plugin_that_failed_after_adding_them_are_removed(monkeypatch, path):
    with _client(monkeypatch, "attach_raises,init_raises") as client:
        assert client.get(path).status_code == 404
        assert path not in client.get("/openapi.json").json()["paths"]


def test_core_route_comes_back_when_its_replacing_plugin_fails_init(monkeypatch):
    with _client(monkeypatch, "replaces_detokenize") as client:
        response = client.post("/detokenize", json={"tokens": "not a list"})
        assert response.status_code == 400  # the core route's validation, not the plugin
        assert response.json()["error"]["param"] == "tokens"
    assert load_report().get(ENDPOINT_PLUGINS_GROUP, "replaces_detokenize").outcome == "init-failed"


def test_plugin_handler_error_is_a_500_with_the_request_id_and_no_traceback(monkeypatch,
                                                                            caplog):
    with _client(monkeypatch, "crashes,hello") as client:
        response = client.get("/v1/crash", headers={"X-Request-Id": "req-42"})
        assert response.status_code == 500
        assert response.headers["x-request-id"] == "req-42"
        error = response.json()["error"]
        assert "req-42" in error["message"] and error["type"] == "server_error"
        assert "SECRET-TRACEBACK-DETAIL" not in response.text
        assert client.get("/v1/hello").status_code == 200  # still serving
    assert any("SECRET-TRACEBACK-DETAIL" in (r.exc_text or "") for r in caplog.records)


def test_plugin_routes_are_not_attached_for_a_task_less_model(monkeypatch):
    with _client(monkeypatch, "hello", supported_tasks=("embed",)) as client:
        assert client.get("/v1/hello").status_code == 200  # required_tasks None
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 404
