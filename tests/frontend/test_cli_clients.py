"""`gateway chat` and `gateway complete` against a real server (the tiny model, greedy by
its generation config, behind an API key): what they print is what the openai SDK gets."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from gateway.frontend.cli.chat import Conversation
from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.plugin_dists import subprocess_env

pytestmark = pytest.mark.e2e
KEY = "cli-secret"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    greedy = tmp_path_factory.mktemp("greedy")
    (greedy / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    with tiny_server(tiny_model, "--max-model-len", "160", "--generation-config", str(greedy),
                     VLLM_API_KEY=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=120)


def _gateway(server, *argv: str, stdin: str = "", key: str | None = KEY):
    env = subprocess_env()
    env.pop("OPENAI_API_KEY", None)
    flags = ["--url", server.url("/v1"), *(["--api-key", key] if key else [])]
    return subprocess.run([sys.executable, "-m", "gateway.frontend.cli.main", *argv, *flags],
                          input=stdin, capture_output=True, text=True, timeout=300, env=env)


def test_chat_quick_prints_the_streamed_answer_with_the_system_prompt(server, sdk):
    result = _gateway(server, "chat", "--model-name", SERVED_NAME, "--system-prompt",
                      "Answer briefly.", "--quick", "Hello", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    expected = sdk.chat.completions.create(model=SERVED_NAME, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello"}],
        max_tokens=12)
    assert expected.choices[0].message.content
    assert result.stdout == expected.choices[0].message.content + "\n"


def test_chat_keeps_the_conversation_until_the_end_of_input(server, sdk):
    result = _gateway(server, "chat", "--max-tokens", "12", stdin="Hello\nAnd again\n")
    assert result.returncode == 0, result.stderr
    first = sdk.chat.completions.create(model=SERVED_NAME, messages=[
        {"role": "user", "content": "Hello"}], max_tokens=12).choices[0].message.content
    second = sdk.chat.completions.create(model=SERVED_NAME, messages=[
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
        {"role": "user", "content": "And again"}], max_tokens=12).choices[0].message.content
    assert result.stdout == f"> {first}\n> {second}\n> "
    assert f"Using model: {SERVED_NAME}" in result.stderr  # named by /v1/models


def test_complete_quick_prints_the_streamed_completion(server, sdk):
    result = _gateway(server, "complete", "--quick", "The quick brown", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    expected = sdk.completions.create(model=SERVED_NAME, prompt="The quick brown", max_tokens=8)
    assert result.stdout == expected.choices[0].text + "\n"


@pytest.mark.parametrize("command", ["chat", "complete"])
def test_a_missing_api_key_or_a_dead_url_is_a_clear_error(server, command):
    result = _gateway(server, command, "--quick", "Hi", key=None)
    assert result.returncode == 1
    assert "HTTP 401" in result.stderr and "Traceback" not in result.stderr
    dead = subprocess.run([sys.executable, "-m", "gateway.frontend.cli.main", command,
                           "--url", "http://127.0.0.1:9/v1", "--quick", "Hi"],
                          capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert dead.returncode == 1 and "cannot reach http://127.0.0.1:9/v1" in dead.stderr


def test_a_conversation_puts_the_system_prompt_first_and_keeps_each_turn():
    conversation = Conversation("Be kind.")
    conversation.ask("Hi")
    conversation.answered("Hello!")
    assert conversation.ask("Bye") == [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert Conversation().ask("Hi") == [{"role": "user", "content": "Hi"}]
