"""The app's shape without generating: core routes by task, error shapes and statuses,
X-Request-Id, the body limit, health and the plugin report.

Requests here stop before the engine (validation, routing, middleware) or read only what
the engine client states (its model name, whether it is dead, its plugin records).
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from gateway.frontend.app import build_app, core_routers, served_tasks
from tests.frontend.conftest import EngineInfo, serve_config

GENERATE_ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                   ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
                   ("POST", "/tokenize"), ("POST", "/detokenize")]
SCORE_ROUTES = [("POST", "/score"), ("POST", "/v1/score"), ("POST", "/rerank"),
                ("POST", "/v1/rerank"), ("POST", "/v2/rerank")]
TOKENIZE_ROUTES = [("POST", "/tokenize"), ("POST", "/detokenize")]
# An embedding model scores pairs too, by cosine similarity (as vLLM).
EMBED_ROUTES = [("POST", "/v1/embeddings"), ("POST", "/pooling"), *TOKENIZE_ROUTES,
                *SCORE_ROUTES]
COMMON_ROUTES = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/load"),
                 ("GET", "/version"), ("GET", "/metrics"), ("GET", "/v1/models"),
                 ("GET", "/v1/plugins")]


def _client(*argv: str, **engine) -> TestClient:
    return TestClient(build_app(serve_config(*argv), EngineInfo(**engine)))


def _routes(tasks: tuple[str, ...]) -> set[tuple[str, str]]:
    return {(method, route.path) for router in core_routers(tasks) for route in router.routes
            for method in route.methods}


def test_a_generate_model_gets_the_generation_routes_and_the_common_ones():
    assert _routes(("generate",)) == set(GENERATE_ROUTES + COMMON_ROUTES)


def test_an_embedding_model_gets_the_pooling_routes_and_no_generation_route():
    assert _routes(("embed",)) == set(EMBED_ROUTES + COMMON_ROUTES)
    with _client(supported_tasks=("embed",)) as client:
        response = client.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 404


@pytest.mark.parametrize(("tasks", "routes"), [
    (("classify",), [("POST", "/classify"), *TOKENIZE_ROUTES]),
    (("score",), [*SCORE_ROUTES, *TOKENIZE_ROUTES]),
    (("classify", "score"), [("POST", "/classify"), *SCORE_ROUTES, *TOKENIZE_ROUTES]),
])
def test_a_classifier_gets_classify_and_a_cross_encoder_the_score_routes(tasks, routes):
    assert _routes(tasks) == set(routes + COMMON_ROUTES)


def test_an_io_processor_adds_the_plugin_task_and_pooling_to_any_model():
    assert _routes(("generate", "plugin")) == set(GENERATE_ROUTES + COMMON_ROUTES
                                                   + [("POST", "/pooling")])
    assert served_tasks(("embed",), object()) == ("embed", "plugin")
    assert served_tasks(("embed",), None) == ("embed",)


def test_health_is_200_then_503_once_the_engine_is_dead():
    engine = EngineInfo()
    with TestClient(build_app(serve_config(), engine)) as client:
        assert client.get("/health").status_code == 200
        engine.is_dead, engine.dead_reason = True, "engine core exited"
        response = client.get("/health")
        assert response.status_code == 503
        assert "engine core exited" in response.json()["error"]["message"]
        assert client.get("/ping").status_code == 503


def test_version_and_models_describe_the_server():
    with _client(model_name="tiny", max_model_len=64) as client:
        assert client.get("/version").json()["version"]
        (card,) = client.get("/v1/models").json()["data"]
        assert (card["id"], card["object"], card["max_model_len"]) == ("tiny", "model", 64)


def test_plugins_route_merges_the_front_end_and_engine_records():
    engine_record = {"group": "vllm.general_plugins", "name": "x", "process_role": "worker-0",
                     "pid": 123, "outcome": "called"}
    with _client(records=[engine_record]) as client:
        data = client.get("/v1/plugins").json()["data"]
    assert engine_record in data


def test_metrics_renders_the_apps_registry():
    with _client() as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("sent", [None, "client-chosen-id"])
def test_every_response_carries_an_x_request_id(sent):
    headers = {"X-Request-Id": sent} if sent else {}
    with _client() as client:
        for path in ("/health", "/no-such-route"):
            response = client.get(path, headers=headers)
            assert response.headers["x-request-id"] == (sent or response.headers[
                "x-request-id"])
            assert len(response.headers["x-request-id"]) >= 8


def test_an_unusable_client_request_id_is_replaced():
    with _client() as client:
        response = client.get("/health", headers={"X-Request-Id": "x" * 500})
    assert response.headers["x-request-id"] != "x" * 500


def test_unknown_route_is_an_openai_shaped_404():
    with _client() as client:
        response = client.post("/v1/nothing-here", json={})
    assert response.status_code == 404
    assert response.json() == {"error": {
        "message": "Unknown request URL: POST /v1/nothing-here.",
        "type": "invalid_request_error", "param": None, "code": "unknown_url"}}


def test_wrong_method_is_a_405():
    with _client() as client:
        response = client.get("/v1/completions")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_body_that_is_not_json_is_a_400():  # vLLM's status for any validation error
    with _client() as client:
        response = client.post("/v1/completions", content=b"{not json",
                               headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "json_invalid"
    assert "not valid JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({}, "prompt"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": {"a": 1}}, "prompt"),
])
def test_wrong_fields_are_a_400_naming_the_param(body, param):
    with _client() as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": "other", "prompt": "hi"}),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user",
                                                              "content": "hi"}]}),
    ("/tokenize", {"model": "other", "prompt": "hi"}),
])
def test_a_model_other_than_the_served_one_is_a_404(path, body):
    with _client(model_name="tiny") as client:
        response = client.post(path, json=body)
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found")


def test_body_over_the_limit_by_content_length_is_a_413():
    with _client("--max-request-body-bytes", "1000") as client:
        response = client.post("/v1/completions", json={"prompt": "x" * 2000})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert response.headers["x-request-id"]


def test_chunked_body_over_the_limit_is_a_413():
    def chunks():
        payload = json.dumps({"prompt": "x" * 5000}).encode()
        for start in range(0, len(payload), 500):
            yield payload[start:start + 500]

    with _client("--max-request-body-bytes", "1000") as client:
        response = client.post("/v1/completions", content=chunks(),
                               headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_docs_can_be_turned_off():
    with _client() as client:
        assert client.get("/openapi.json").status_code == 200
    with _client("--disable-fastapi-docs") as client:
        assert client.get("/openapi.json").status_code == 404
        assert client.get("/docs").status_code == 404
