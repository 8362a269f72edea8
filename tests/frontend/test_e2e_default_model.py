"""End to end: `gateway serve` with no MODEL serves the embedded default model
(SmolLM2-135M-Instruct, shipped on PyPI as GGUF), offline, through the openai SDK."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

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


def _readme_curl_command() -> str:
    """The README's first example request, as written there."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```sh\n(curl localhost:8000/v1/chat/completions.*?)```", readme,
                      re.DOTALL)
    assert block is not None, "the README's curl example is gone"
    return block.group(1)


def test_the_readme_example_gets_a_short_right_answer_within_seconds(server):
    command = _readme_curl_command().replace("localhost:8000", f"{server.host}:{server.port}")
    for _ in range(3):
        started = time.monotonic()
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                                timeout=60, check=True)
        assert time.monotonic() - started < 30
        answer = json.loads(result.stdout)
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert "Paris" in choice["message"]["content"], choice
        assert answer["usage"]["completion_tokens"] < 64


def test_the_start_up_log_names_the_model_cards_sampling_defaults(server):
    log = server.log_text()
    assert "Using default chat sampling params from model: " \
        "{'temperature': 0.2, 'top_p': 0.9}" in log
    assert "--generation-config vllm" in log
