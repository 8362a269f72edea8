"""End to end: the real server on a tiny random RoBERTa embedding model (task embed):
/v1/embeddings through the openai SDK equals transformers (positions from
pad_token_id + 1, mean pooling, normalised); /score and /rerank score by cosine
similarity, as vLLM does for an embedding model; no /classify."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

from tests.frontend.encoder_servers import SERVED_NAME, attached_task_plugins, encoder_server
from tests.tiny_model import build_tiny_encoder

pytestmark = pytest.mark.e2e

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world!",
         "Plugins extend the gateway through Python entry points."]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return build_tiny_encoder(tmp_path_factory.mktemp("models") / "roberta", "RobertaModel")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("embed-server")
    with encoder_server(model, root / "site", root / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def reference(model) -> np.ndarray:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    encoder = AutoModel.from_pretrained(str(model), add_pooling_layer=False).eval()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = encoder(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()


def test_the_openai_sdk_gets_the_reference_embeddings(server, reference) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    result = client.embeddings.create(model=SERVED_NAME, input=TEXTS)
    vectors = np.array([item.embedding for item in result.data])
    assert vectors.shape == (3, 64)
    assert np.abs(vectors - reference).max() < 1e-5


def test_score_and_rerank_are_cosine_similarities(http, reference) -> None:
    cosine = reference[1:] @ reference[0]  # unit vectors
    scored = http.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(cosine.tolist(), abs=1e-5)
    reranked = http.post("/v2/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:]}).json()
    assert [r["index"] for r in reranked["results"]] == np.argsort(-cosine).tolist()
    assert reranked["results"][0]["relevance_score"] == pytest.approx(cosine.max(), abs=1e-5)


def test_an_embedding_model_refuses_what_only_a_cross_encoder_does(http) -> None:
    response = http.post("/score", json={"text_1": "a", "text_2": "b", "use_activation": False})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "use_activation"
    assert http.post("/classify", json={"input": "a"}).status_code == 404
    assert attached_task_plugins(http) == {"embed"}
