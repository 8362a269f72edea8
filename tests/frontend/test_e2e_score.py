"""End to end: the real server on a tiny random BERT cross-encoder (one label: tasks
classify and score): /score and /v1/score (1:N, N:N, vLLM's other field names), /rerank,
/v1/rerank and /v2/rerank (order, top_n, return_documents), truncation of long pairs,
/classify on single texts, the 400s, and which routes and task-gated plugins attach; every
score checked against transformers' sigmoid of its logits (sentence-transformers'
CrossEncoder semantics, with token types for the second text)."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.frontend.encoder_servers import (
    SERVED_NAME,
    attached_task_plugins,
    encoder_server,
    reference_logits,
)
from tests.tiny_model import build_tiny_encoder

pytestmark = pytest.mark.e2e

QUERY = "what is a fox?"
DOCUMENTS = ["the quick brown fox jumps over the lazy dog.", "hello, world!",
             "plugins extend the gateway through python entry points.",
             "once upon a time there was a server that answered every request."]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return build_tiny_encoder(tmp_path_factory.mktemp("models") / "cross-encoder",
                              "BertForSequenceClassification", num_labels=1)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("score-server")
    with encoder_server(model, root / "site", root / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def reference(model):  # type: ignore[no-untyped-def]
    logits, num_tokens = reference_logits(model, [QUERY] * len(DOCUMENTS), DOCUMENTS)
    return torch.sigmoid(logits[:, 0]).tolist(), num_tokens


def _post(http, path: str, **body):  # type: ignore[no-untyped-def]
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_one_to_many_equals_the_cross_encoder(http, reference, path: str) -> None:
    scores, num_tokens = reference
    body = _post(http, path, model=SERVED_NAME, text_1=QUERY, text_2=DOCUMENTS)
    assert body["object"] == "list" and body["model"] == SERVED_NAME
    assert body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert {d["object"] for d in body["data"]} == {"score"}
    assert [d["score"] for d in body["data"]] == pytest.approx(scores, abs=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(num_tokens)


@pytest.mark.parametrize("fields", [("text_1", "text_2"), ("queries", "documents"),
                                    ("data_1", "data_2")])
def test_score_n_to_n_pairs_in_order_by_any_field_names(http, reference, fields) -> None:
    body = _post(http, "/score", **{fields[0]: [QUERY] * 4, fields[1]: DOCUMENTS})
    assert [d["score"] for d in body["data"]] == pytest.approx(reference[0], abs=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_the_cross_encoder(http, reference, path: str) -> None:
    scores = reference[0]
    body = _post(http, path, query=QUERY, documents=DOCUMENTS)
    order = sorted(range(4), key=lambda i: -scores[i])
    assert [r["index"] for r in body["results"]] == order
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
        [scores[i] for i in order], abs=1e-5)
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]
    assert body["model"] == SERVED_NAME and body["id"].startswith("rerank-")
    assert body["usage"]["total_tokens"] == sum(reference[1])


def test_rerank_top_n_and_return_documents(http, reference) -> None:
    best = max(range(4), key=lambda i: reference[0][i])
    body = _post(http, "/rerank", query=QUERY, documents=DOCUMENTS, top_n=2,
                 return_documents=False)
    assert len(body["results"]) == 2 and body["results"][0]["index"] == best
    assert all("document" not in r for r in body["results"])


def test_use_activation_false_gives_the_logit(http, model) -> None:
    logits, _ = reference_logits(model, [QUERY], [DOCUMENTS[0]])
    body = _post(http, "/score", text_1=QUERY, text_2=DOCUMENTS[0], use_activation=False)
    assert body["data"][0]["score"] == pytest.approx(float(logits[0, 0]), abs=1e-4)


def test_a_long_pair_is_cut_longest_first_when_asked(http, model) -> None:
    long_query, long_document = "fox " * 80, "the lazy dog " * 60  # > 128 tokens together
    response = http.post("/score", json={"text_1": long_query, "text_2": long_document})
    assert response.status_code == 400 and "truncate_prompt_tokens" in response.text
    logits, num_tokens = reference_logits(model, [long_query], [long_document],
                                          truncation=True, max_length=40)
    body = _post(http, "/score", text_1=long_query, text_2=long_document,
                 truncate_prompt_tokens=40)
    assert body["usage"]["prompt_tokens"] == num_tokens[0] == 40
    assert body["data"][0]["score"] == pytest.approx(float(torch.sigmoid(logits[0, 0])),
                                                     abs=1e-5)


def test_classify_gives_the_one_label_probability(http, model) -> None:
    logits, _ = reference_logits(model, DOCUMENTS[:2])
    body = _post(http, "/classify", input=DOCUMENTS[:2])
    assert [d["num_classes"] for d in body["data"]] == [1, 1]
    assert [d["label"] for d in body["data"]] == ["LABEL_0", "LABEL_0"]
    assert [d["probs"][0] for d in body["data"]] == pytest.approx(
        torch.sigmoid(logits[:, 0]).tolist(), abs=1e-5)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/score", {"text_2": ["a"]}, "text_1"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority"),
    ("/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2"),
    ("/rerank", {"query": "", "documents": ["b"]}, "query"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model"),
])
def test_bad_score_requests_are_4xx_naming_the_field(http, path: str, body, param) -> None:
    response = http.post(path, json=body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["param"] == param


def test_only_the_routes_and_plugins_of_classify_and_score_attach(http) -> None:
    assert http.post("/v1/embeddings", json={"input": "a"}).status_code == 404
    assert http.post("/v1/completions", json={"prompt": "a"}).status_code == 404
    assert attached_task_plugins(http) == {"classify", "score"}


def test_the_openai_sdk_reaches_score_and_rerank(server, reference) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    scored = client.post("/score", cast_to=object, body={"text_1": QUERY, "text_2": DOCUMENTS})
    reranked = client.post("/rerank", cast_to=object,
                           body={"query": QUERY, "documents": DOCUMENTS, "top_n": 1})
    assert [d["score"] for d in scored["data"]] == pytest.approx(reference[0], abs=1e-5)
    assert reranked["results"][0]["relevance_score"] == pytest.approx(max(reference[0]),
                                                                      abs=1e-5)
