"""End to end: the real server on a tiny random XLM-R classifier (three named labels: task
classify only): /classify of texts and token ids equals transformers' softmax of its
logits, with the best label's name; use_activation (and vLLM's older names); and no
/score, /rerank or /v1/embeddings, nor the plugins gated on those tasks."""

from __future__ import annotations

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

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world!",
         "Plugins extend the gateway through Python entry points."]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return build_tiny_encoder(tmp_path_factory.mktemp("models") / "classifier",
                              "XLMRobertaForSequenceClassification", num_labels=3,
                              id2label=LABELS, label2id={v: k for k, v in LABELS.items()})


@pytest.fixture(scope="module")
def server(model, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("classify-server")
    with encoder_server(model, root / "site", root / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def reference(model):  # type: ignore[no-untyped-def]
    return reference_logits(model, TEXTS)


def _classify(http, **body):  # type: ignore[no-untyped-def]
    response = http.post("/classify", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_classify_equals_transformers_softmax_with_label_names(http, reference) -> None:
    logits, num_tokens = reference
    body = _classify(http, model=SERVED_NAME, input=TEXTS)
    probs = torch.softmax(logits, -1)
    assert body["object"] == "list" and body["id"].startswith("classify-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["num_classes"] for d in body["data"]] == [3, 3, 3]
    for item, row in zip(body["data"], probs, strict=True):
        assert item["probs"] == pytest.approx(row.tolist(), abs=1e-5)
        assert item["label"] == LABELS[int(row.argmax())]
    assert body["usage"]["prompt_tokens"] == sum(num_tokens)
    assert body["usage"]["completion_tokens"] == 0


def test_token_ids_classify_like_their_text(http) -> None:
    token_ids = http.post("/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_text = _classify(http, input=TEXTS[0])["data"][0]["probs"]
    assert _classify(http, input=token_ids)["data"][0]["probs"] == pytest.approx(by_text,
                                                                                 abs=1e-6)


@pytest.mark.parametrize("field", ["use_activation", "activation", "softmax"])
def test_activation_off_gives_the_logits(http, reference, field: str) -> None:
    body = _classify(http, input=TEXTS, **{field: False})
    for item, row in zip(body["data"], reference[0], strict=True):
        assert item["probs"] == pytest.approx(row.tolist(), abs=1e-4)


def test_a_classifier_without_one_label_serves_no_scores_or_embeddings(http) -> None:
    assert http.post("/score", json={"text_1": "a", "text_2": "b"}).status_code == 404
    assert http.post("/rerank", json={"query": "a", "documents": ["b"]}).status_code == 404
    assert http.post("/v1/embeddings", json={"input": "a"}).status_code == 404
    assert attached_task_plugins(http) == {"classify"}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": [1, 10**6]}, "input"),
    ({"input": "a", "priority": 2}, "priority"),
    ({"input": "word " * 200}, "input"),
])
def test_bad_classify_requests_are_400_naming_the_field(http, body, param: str) -> None:
    response = http.post("/classify", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
