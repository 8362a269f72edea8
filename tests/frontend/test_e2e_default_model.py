"""End to end: `gateway serve` with no MODEL serves the embedded default model
(SmolLM2-135M-Instruct, shipped on PyPI as GGUF), offline, through the openai SDK."""

from __future__ import annotations

import openai
import pytest

from tests.plugin_dists import subprocess_env
from tests.server import ServerProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "default-model-server.log"
    env = subprocess_env()
    env.pop("VLLM_API_KEY", None)
    flags = ["--max-model-len", "2048", "--kv-cache-memory", "256MiB",
             "--disable-uvicorn-access-log"]
    with ServerProcess(flags, env=env, log_path=log) as server:
        yield server


def test_default_model_is_served_under_its_name(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    (model,) = client.models.list().data
    assert "smollm2" in model.id.lower()


def test_default_model_answers_a_chat(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    result = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_completion_tokens=16, temperature=0)
    assert "Paris" in result.choices[0].message.content
