"""End to end: the real `gateway serve` on the embedding default (all-MiniLM-L6-v2):
/v1/embeddings through the openai SDK and httpx, /pooling, the embed-gated example
endpoint plugin, and /pooling driven by the example IO processor (rule 8)."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from gateway.models.info.paths import default_embedding_model_path
from gateway.plugins import ENDPOINT_PLUGINS_GROUP, IO_PROCESSOR_PLUGINS_GROUP
from tests.conftest import run_gateway
from tests.plugin_dists import subprocess_env
from tests.server import ServerProcess

pytestmark = pytest.mark.e2e

MODEL = "all-MiniLM-L6-v2"
SENTENCES = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog!",
             "Plugins extend the gateway through Python entry points, found at start-up.",
             "naïve café — 東京 🚀"]
LONG = "word " * 600  # > 512 tokens


def _server(*flags, roots=(), log_path=None, **env):
    environment = subprocess_env(*roots, **env)
    environment.pop("VLLM_API_KEY", None)
    return ServerProcess([MODEL, "--disable-uvicorn-access-log", *flags], env=environment,
                         log_path=log_path)


@pytest.fixture(scope="module")
def server(example_plugins_site, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "embed-server.log"
    with _server(roots=(example_plugins_site,), log_path=log,
                 VLLM_PLUGINS="dedupe,summarize") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """transformers + mean pooling + L2 normalisation: what sentence-transformers computes."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = default_embedding_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def _embed(http, **body):
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    return response.json()


# ------------------------------------------------------------------ /v1/embeddings
def test_the_openai_sdk_gets_the_reference_embeddings(client, reference):
    result = client.embeddings.create(model=MODEL, input=SENTENCES)  # base64 on the wire
    vectors = np.array([item.embedding for item in result.data])
    assert [item.index for item in result.data] == [0, 1, 2, 3]
    cosine = (vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1)
    assert (1 - cosine).max() < 1e-4
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert result.usage.prompt_tokens == result.usage.total_tokens > 4 * 3


def test_float_and_base64_carry_the_same_vector(http):
    floats = _embed(http, input=SENTENCES[0])["data"][0]["embedding"]
    encoded = _embed(http, input=SENTENCES[0], encoding_format="base64")["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist() == pytest.approx(
        floats, abs=1e-7)
    assert len(floats) == 384


def test_token_ids_embed_like_the_text_they_encode(http):
    token_ids = http.post("/tokenize", json={"prompt": SENTENCES[1]}).json()["tokens"]
    by_text = _embed(http, input=SENTENCES[1])["data"][0]["embedding"]
    for body in ({"input": token_ids}, {"input": [token_ids, token_ids]}):
        for item in _embed(http, **body)["data"]:
            assert item["embedding"] == pytest.approx(by_text, abs=1e-6)


def test_concurrent_clients_get_the_vectors_they_would_get_alone(server, http):
    alone = [_embed(http, input=s)["data"][0]["embedding"] for s in SENTENCES]

    async def together():
        async with httpx.AsyncClient(base_url=server.url(), timeout=60) as client:
            responses = await asyncio.gather(*(
                client.post("/v1/embeddings", json={"input": SENTENCES[i % 4]})
                for i in range(32)))
        return [r.json()["data"][0]["embedding"] for r in responses]

    for i, vector in enumerate(asyncio.run(together())):
        assert vector == pytest.approx(alone[i % 4], abs=1e-5)


def test_normalize_false_gives_the_raw_mean(http):
    raw = np.array(_embed(http, input=SENTENCES[0], normalize=False)["data"][0]["embedding"])
    unit = np.array(_embed(http, input=SENTENCES[0])["data"][0]["embedding"])
    assert abs(np.linalg.norm(raw) - 1.0) > 0.01
    assert raw / np.linalg.norm(raw) == pytest.approx(unit, abs=1e-6)


def test_dimensions_equal_to_the_model_size_is_accepted(http):
    assert len(_embed(http, input="hi", dimensions=384)["data"][0]["embedding"]) == 384


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": []}, "input", "must not be empty"),
    ({"input": ""}, "input", "empty string"),
    ({"input": ["fine", ""]}, "input", "input[1]` is an empty string"),
    ({"input": ["fine", 3]}, "input", "must be a string, a list of strings"),
    ({"input": [[]]}, "input", "has no tokens"),
    ({"input": ["x"] * 2049}, "input", "at most 2048"),
    ({"input": [1, 2, 10**6]}, "input", "out of range"),
    ({"input": LONG}, "input", "more than the model's maximum of 512"),
    ({"input": "hi", "dimensions": 100}, "dimensions", "not a Matryoshka model"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "between 1"),
    ({"input": "hi", "model": "other"}, "model", "does not exist"),
])
def test_bad_input_is_a_clear_4xx(http, body, param, words):
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert response.headers["x-request-id"]


def test_a_long_input_is_cut_only_when_the_request_asks(http):
    full = _embed(http, input=LONG, truncate_prompt_tokens=-1)
    assert full["usage"]["prompt_tokens"] == 512
    short = _embed(http, input=LONG, truncate_prompt_tokens=20)
    assert short["usage"]["prompt_tokens"] == 20


# ------------------------------------------------------------------ the rest of the surface
def test_pooling_without_an_io_processor_pools_the_input(http):
    pooled = http.post("/pooling", json={"input": SENTENCES[:2]}).json()
    embedded = _embed(http, input=SENTENCES[:2])
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    for p, e in zip(pooled["data"], embedded["data"]):
        assert p["data"] == pytest.approx(e["embedding"], abs=1e-6)
    assert http.post("/pooling", json={"data": {"query": "x"}}).json()["error"]["param"] == \
        "input"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/summarize"])
def test_generation_routes_are_not_served_by_an_embedding_model(http, path):
    assert http.post(path, json={"prompt": "hi"}).status_code == 404


def test_the_embed_gated_plugin_is_attached_and_pools_through_the_engine(http):
    body = {"texts": ["The cat sat on the mat.", "The cat sat on the mat!",
                      "Interest rates rose again this quarter."], "threshold": 0.9}
    result = http.post("/v1/dedupe", json=body).json()
    assert result["groups"] == [[0, 1], [2]]
    assert [(p["first"], p["second"]) for p in result["pairs"]] == [(0, 1)]
    records = http.get("/v1/plugins").json()["data"]
    outcomes = {r["name"]: r["outcome"] for r in records if r["group"] == ENDPOINT_PLUGINS_GROUP}
    assert outcomes["dedupe"] == "attached" and outcomes["summarize"] == "skipped-tasks"


def test_prompt_tokens_reach_the_metrics(http):
    def counter():
        text = http.get("/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:prompt_tokens_total{"))

    before = counter()
    used = _embed(http, input=SENTENCES)["usage"]["prompt_tokens"]
    assert counter() - before == used


# ------------------------------------------------------------------ IO processor (rule 8)
@pytest.fixture(scope="module")
def search_server(example_plugins_site, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "search-server.log"
    with _server("--io-processor-plugin", "semantic_search", roots=(example_plugins_site,),
                 log_path=log) as server:
        yield server


def test_pooling_runs_the_io_processor_end_to_end(search_server):
    documents = ["Opening hours are nine to five on weekdays.",
                 "To change your password, open Settings and choose Security.",
                 "Our office is closed on public holidays."]
    with httpx.Client(base_url=search_server.url(), timeout=60) as http:
        response = http.post("/pooling", json={"data": {
            "query": "How do I reset my password?", "documents": documents, "top_k": 2}})
        assert response.status_code == 200, response.text
        body = response.json()
        results = body["data"]["results"]
        assert body["request_id"].startswith("pool-") and body["created_at"] > 0
        assert [r["index"] for r in results][0] == 1 and len(results) == 2
        assert results[0]["document"] == documents[1]
        assert results[0]["score"] > results[1]["score"]
        records = http.get("/v1/plugins").json()["data"]
    (record,) = [r for r in records if r["group"] == IO_PROCESSOR_PLUGINS_GROUP]
    assert (record["name"], record["outcome"]) == ("semantic_search", "selected")


@pytest.mark.parametrize(("data", "words"), [
    ({"query": "x"}, "documents"),
    ({"query": "", "documents": ["a"]}, "query"),
    ({"query": "x", "documents": ["a", ""]}, "must not contain an empty string"),
    ("just text", "must be an object"),
])
def test_data_the_processor_refuses_is_a_400_with_its_message(search_server, data, words):
    response = httpx.post(search_server.url("/pooling"), json={"data": data}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "data" and "SemanticSearchProcessor refused the data" in \
        error["message"] and words in error["message"]


def test_a_named_io_processor_that_is_missing_stops_start_up_listing_the_available(
        example_plugins_site):
    proc = run_gateway("serve", MODEL, "--io-processor-plugin", "nope",
                       roots=(example_plugins_site,))
    assert proc.returncode == 1
    assert "'nope'" in proc.stderr and "available: semantic_search" in proc.stderr
    assert "Engine core ready" not in proc.stderr  # it stopped before the engine started
