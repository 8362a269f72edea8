"""API-key auth: every route but the public set needs the key, plugin routes included."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gateway.frontend.app import build_app
from tests.frontend.conftest import EngineInfo, serve_config

KEY = "sk-test-0123456789"
PUBLIC = ["/health", "/ping", "/version", "/metrics"]
PROTECTED = [("GET", "/v1/models"), ("GET", "/v1/plugins"), ("POST", "/v1/completions"),
             ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
             ("GET", "/v1/responses/resp_1"), ("POST", "/tokenize"), ("POST", "/detokenize"),
             ("GET", "/openapi.json"), ("GET", "/no-such-route"), ("GET", "/v1/hello")]


@pytest.fixture
def client(fake_endpoints, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "hello")
    with TestClient(build_app(serve_config("--api-key", KEY), EngineInfo())) as client:
        yield client


@pytest.mark.parametrize("path", PUBLIC)
def test_public_paths_need_no_key(client, path):
    assert client.get(path).status_code == 200


@pytest.mark.parametrize(("method", "path"), PROTECTED)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", KEY,
                                           f"Bearer {KEY}x"])
def test_every_other_route_needs_the_key(client, method, path, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    response = client.request(method, path, headers=headers, json={})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert KEY not in response.text


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_the_key_opens_core_and_plugin_routes(client, scheme):
    headers = {"Authorization": f"{scheme} {KEY}"}
    assert client.get("/v1/models", headers=headers).status_code == 200
    assert client.get("/v1/hello", headers=headers).json() == {"plugin": "hello-plugin"}
    assert client.get("/no-such-route", headers=headers).status_code == 404


def test_protect_metrics_takes_metrics_out_of_the_public_set(monkeypatch):
    config = serve_config("--api-key", KEY, "--protect-metrics")
    with TestClient(build_app(config, EngineInfo())) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/health").status_code == 200
        headers = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/metrics", headers=headers).status_code == 200


def test_the_key_can_come_from_vllm_api_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    with TestClient(build_app(serve_config(), EngineInfo())) as client:
        assert client.get("/v1/models").status_code == 401
        headers = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=headers).status_code == 200


def test_no_key_means_no_auth():
    with TestClient(build_app(serve_config(), EngineInfo())) as client:
        assert client.get("/v1/models").status_code == 200


def test_public_paths_stay_public_under_a_root_path():
    config = serve_config("--api-key", KEY, "--root-path", "/api")
    with TestClient(build_app(config, EngineInfo()), root_path="/api") as client:
        assert client.get("/api/health").status_code == 200
        assert client.get("/api/v1/models").status_code == 401
