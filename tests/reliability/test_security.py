"""End to end: with --api-key, every route of the app (the core routes, the docs, and the
routes of the example endpoint plugins pip-installed from endpoint_plugins/) refuses a
missing or wrong key with 401, except the public set; and no error body ever echoes the
key, the prompt or a traceback. One server for the module.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.frontend.conftest import EXAMPLE_PLUGINS, tiny_server

pytestmark = pytest.mark.e2e

KEY = "sk-reliability-9f3c1e7a"
AUTH = {"Authorization": f"Bearer {KEY}"}
PUBLIC = {"/health", "/ping", "/version", "/metrics"}
#: Routes FastAPI serves but leaves out of the schema.
UNLISTED = {("/openapi.json", "GET"), ("/docs", "GET"), ("/docs/oauth2-redirect", "GET"),
            ("/redoc", "GET")}
WRONG_KEYS = {
    "missing": {},
    "wrong": {"Authorization": "Bearer sk-wrong"},
    "key-plus-one": {"Authorization": f"Bearer {KEY}x"},
    "key-prefix": {"Authorization": f"Bearer {KEY[:-1]}"},
    "no-scheme": {"Authorization": KEY},
    "basic-scheme": {"Authorization": f"Basic {KEY}"},
    "empty-bearer": {"Authorization": "Bearer"},
    "other-header": {"X-API-Key": KEY},
}
SECRET_PROMPT = "zebra-umbrella-5521-secret-prompt"


@pytest.fixture(scope="module")
def server(tiny_model, example_plugins_site, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "security-server.log"
    with tiny_server(tiny_model, "--api-key", KEY, roots=(example_plugins_site,),
                     log_path=log, VLLM_PLUGINS=",".join(EXAMPLE_PLUGINS)) as server:
        yield server


def app_routes(http) -> list[tuple[str, str]]:
    """Every (path, method) of the app: the OpenAPI schema plus the unlisted docs routes,
    path parameters filled with a placeholder."""
    schema = http.get("/openapi.json", headers=AUTH)
    assert schema.status_code == 200
    found = set(UNLISTED)
    for path, operations in schema.json()["paths"].items():
        for method in operations:
            found.add((re.sub(r"\{[^}]*\}", "x", path), method.upper()))
    return sorted(found)


@pytest.fixture(scope="module")
def routes(http) -> list[tuple[str, str]]:
    found = app_routes(http)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/plugins", "/tokenize",
            "/v1/summarize", "/v1/server-info"} <= {path for path, _ in found}
    return found


def test_every_route_but_the_public_set_needs_the_key(http, routes):
    assert_only_public_routes_are_open(http, routes)


def assert_only_public_routes_are_open(http, routes) -> None:
    open_routes = []
    for path, method in routes:
        for case, headers in WRONG_KEYS.items():
            response = http.request(method, path, headers=headers, json={})
            if path in PUBLIC:
                assert response.status_code != 401, (path, method, case)
                continue
            if response.status_code != 401:
                open_routes.append((method, path, case, response.status_code))
                continue
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers.get("x-request-id")
            assert KEY not in response.text
    assert not open_routes


@pytest.mark.parametrize("path", ["/nowhere", "/health/../v1/models", "/v1/models/",
                                  "/V1/models", "/metrics/x", "/health/", "//v1/models"])
def test_unknown_and_odd_paths_need_the_key(http, path):
    response = http.get(path)
    assert response.status_code == 401, (path, response.status_code)


def test_the_key_opens_the_routes(http):
    assert http.get("/v1/models", headers=AUTH).status_code == 200
    assert http.get("/v1/server-info", headers=AUTH).status_code == 200


ERRORING = [
    ("/v1/completions", {"prompt": SECRET_PROMPT, "max_tokens": -1}),
    ("/v1/completions", {"prompt": SECRET_PROMPT, "max_tokens": 5000}),
    ("/v1/completions", {"prompt": SECRET_PROMPT, "temperature": "hot"}),
    ("/v1/completions", {"prompt": SECRET_PROMPT, "max_tokens": SECRET_PROMPT}),
    ("/v1/completions", {"prompt": SECRET_PROMPT * 400, "max_tokens": 2}),
    ("/v1/completions", {"prompt": {"text": SECRET_PROMPT}}),
    ("/v1/completions", {"prompt": SECRET_PROMPT, "stop": {"x": SECRET_PROMPT}}),
    ("/v1/completions", {"prompt": SECRET_PROMPT, "logit_bias": {SECRET_PROMPT: 1}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"x": SECRET_PROMPT}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET_PROMPT}],
                              "max_tokens": 5000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET_PROMPT}],
                              "top_p": 7}),
    ("/v1/chat/completions", {"messages": SECRET_PROMPT}),
    ("/tokenize", {"prompt": {"x": SECRET_PROMPT}}),
    ("/detokenize", {"tokens": [SECRET_PROMPT]}),
    ("/v1/summarize", {"text": {"x": SECRET_PROMPT}}),
    ("/v1/summarize", {"text": SECRET_PROMPT, "max_tokens": -3}),
]


@pytest.mark.parametrize(("path", "body"), ERRORING)
def test_error_bodies_echo_no_secret_prompt_or_traceback(http, path, body):
    response = http.post(path, json=body, headers=AUTH)
    assert response.status_code >= 400, (path, body, response.text)
    text = response.text
    assert SECRET_PROMPT not in text and KEY not in text, text
    assert "Traceback" not in text and 'File "' not in text, text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_wrong_key_is_never_echoed(http):
    response = http.post("/v1/completions", json={"prompt": SECRET_PROMPT},
                         headers={"Authorization": f"Bearer {SECRET_PROMPT}"})
    assert response.status_code == 401
    assert SECRET_PROMPT not in response.text


def test_the_key_and_prompt_stay_out_of_the_log(server, http):
    http.post("/v1/completions", json={"prompt": SECRET_PROMPT, "max_tokens": -1},
              headers=AUTH)
    log = server.log_text()
    assert KEY not in log


# ------------------------------------------------------------------ an embedding server
@pytest.fixture(scope="module")
def embed_http(example_plugins_site, tmp_path_factory):
    """all-MiniLM-L6-v2 with the embed-gated plugin and the IO processor, and the key."""
    from tests.plugin_dists import subprocess_env
    from tests.server import ServerProcess

    env = subprocess_env(example_plugins_site, VLLM_PLUGINS="dedupe,server_info,semantic_search")
    env.pop("VLLM_API_KEY", None)
    log = tmp_path_factory.mktemp("logs") / "security-embed-server.log"
    with ServerProcess(["all-MiniLM-L6-v2", "--api-key", KEY, "--io-processor-plugin",
                        "semantic_search", "--disable-uvicorn-access-log"], env=env,
                       log_path=log) as server, \
            httpx.Client(base_url=server.url(), timeout=60) as http:
        yield http


def test_every_route_of_an_embedding_server_but_the_public_set_needs_the_key(embed_http):
    routes = app_routes(embed_http)
    assert {"/v1/embeddings", "/pooling", "/tokenize", "/v1/dedupe",
            "/v1/server-info"} <= {path for path, _ in routes}
    assert_only_public_routes_are_open(embed_http, routes)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/embeddings", {"input": SECRET_PROMPT * 300}),
    ("/v1/embeddings", {"input": [SECRET_PROMPT, 5]}),
    ("/v1/embeddings", {"input": SECRET_PROMPT, "dimensions": 3}),
    ("/v1/embeddings", {"input": SECRET_PROMPT, "encoding_format": SECRET_PROMPT}),
    ("/pooling", {"data": {"query": SECRET_PROMPT}}),
    ("/pooling", {"data": {"query": SECRET_PROMPT, "documents": [SECRET_PROMPT, ""]}}),
    ("/pooling", {"data": SECRET_PROMPT}),
    ("/v1/dedupe", {"texts": [SECRET_PROMPT, ""]}),
    ("/v1/dedupe", {"texts": [SECRET_PROMPT], "threshold": SECRET_PROMPT}),
])
def test_embedding_error_bodies_echo_no_secret_prompt_or_traceback(embed_http, path, body):
    response = embed_http.post(path, json=body, headers=AUTH)
    assert 400 <= response.status_code < 500, (path, body, response.text)
    text = response.text
    assert SECRET_PROMPT not in text and KEY not in text, text
    assert "Traceback" not in text and 'File "' not in text, text

