"""LoRA adapters through the real server and the openai SDK: --lora-modules (both forms),
/v1/models with parents, greedy outputs equal to transformers + PEFT's merged model, adapters
sharing steps, /v1/load_lora_adapter and /v1/unload_lora_adapter, the bad adapters (400
naming them, the base model serving on), the example filesystem resolver pip-installed as a
user would with a raising and a hanging resolver beside it, vllm:lora_requests_info, and a
bad --lora-modules stopping start-up in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.frontend.conftest import REPO, SERVED_NAME, EngineInfo, serve_config, tiny_server
from tests.plugin_dists import write_dist
from tests.server import ServerProcess
from tests.tiny_lora import build_tiny_lora, merged_reference

PROMPT = "The quick brown fox"
MAX_TOKENS = 6
FAILING_RESOLVERS = """
    import asyncio
    from gateway.plugins import LoRAResolver, LoRAResolverRegistry

    class Raising(LoRAResolver):
        async def resolve_lora(self, base_model_name, lora_name):
            raise RuntimeError("the adapter store is down")

    class Hanging(LoRAResolver):
        async def resolve_lora(self, base_model_name, lora_name):
            await asyncio.sleep(3600)

    def register():
        for name, resolver in (("raising", Raising()), ("hanging", Hanging())):
            if name not in LoRAResolverRegistry.get_supported_resolvers():
                LoRAResolverRegistry.register_resolver(name, resolver)
"""


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    cache = root / "resolver-cache"
    found = build_tiny_lora(tiny_model, cache / "found", rank=4, seed=5)
    config = json.loads((found / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = SERVED_NAME  # the filesystem resolver's match
    (found / "adapter_config.json").write_text(json.dumps(config))
    lm_head = shutil.copytree(found, root / "lm_head")  # an adapter of the output layer too
    config["target_modules"] = [*config["target_modules"], "lm_head"]
    (lm_head / "adapter_config.json").write_text(json.dumps(config))
    return {"a": build_tiny_lora(tiny_model, root / "a", rank=4, seed=1),
            "b": build_tiny_lora(tiny_model, root / "b", rank=8, seed=2,
                                 targets=("q_proj", "v_proj", "down_proj")),
            "d": build_tiny_lora(tiny_model, root / "d", rank=2, seed=4),
            "rank16": build_tiny_lora(tiny_model, root / "rank16", rank=16, seed=6),
            "lm_head": lm_head,
            "found": found, "cache": cache}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example resolver pip-installed, and a distribution of two failing resolvers."""
    target = tmp_path_factory.mktemp("resolver-site")
    source = shutil.copytree(REPO / "general_plugins/lora_filesystem_resolver",
                             tmp_path_factory.mktemp("resolver-source") / "resolver")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(target), str(source)], check=True, capture_output=True, timeout=300)
    return write_dist(target, "failing-resolvers",
                      {"vllm.general_plugins": {"failing_resolvers": "failing_resolvers:register"}},
                      {"failing_resolvers": FAILING_RESOLVERS})


@pytest.fixture(scope="module")
def server(tiny_model: Path, adapters: dict[str, Path], site: Path) -> Iterator[ServerProcess]:
    b_module = json.dumps({"name": "b", "path": str(adapters["b"]),
                           "base_model_name": SERVED_NAME})
    with tiny_server(tiny_model, "--dtype", "float32", "--enable-lora", "--max-loras", "2",
                     "--max-lora-rank", "8", "--lora-modules", f"a={adapters['a']}", b_module,
                     roots=(site,), VLLM_ALLOW_RUNTIME_LORA_UPDATING="true",
                     VLLM_LORA_RESOLVER_CACHE_DIR=str(adapters["cache"]),
                     GATEWAY_LORA_RESOLVER_TIMEOUT_S="0.5") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def _complete(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert answer.model == model
    return answer.choices[0].text


def _expected(http: httpx.Client, tiny_model: Path, adapter: Path | None) -> str:
    """transformers + PEFT's merged model, greedy, detokenized by the server."""
    prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    reference = merged_reference(tiny_model, adapter)
    with torch.no_grad():
        tokens = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                    min_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt):]
    return str(http.post("/detokenize", json={"tokens": tokens.tolist()}).json()["prompt"])


def test_models_lists_the_adapters_with_the_base_model_as_parent(client):
    models = {model.id: model for model in client.models.list()}
    assert models["a"].parent == models["b"].parent == SERVED_NAME  # type: ignore[attr-defined]
    assert models[SERVED_NAME].parent is None  # type: ignore[attr-defined]


def test_each_adapter_generates_what_the_merged_model_does(client, http, tiny_model, adapters):
    for name, adapter in (("a", adapters["a"]), ("b", adapters["b"]), (SERVED_NAME, None)):
        assert _complete(client, name) == _expected(http, tiny_model, adapter), name


def test_requests_for_different_adapters_together_equal_each_alone(client):
    alone = {name: _complete(client, name) for name in ("a", "b", SERVED_NAME)}
    assert len(set(alone.values())) == 3
    names = ["a", "b", SERVED_NAME] * 4
    with ThreadPoolExecutor(len(names)) as pool:
        together = list(pool.map(lambda name: _complete(client, name), names))
    assert together == [alone[name] for name in names]


def test_chat_and_responses_select_the_adapter_by_model(client):
    chat = {name: client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        temperature=0, extra_body={"ignore_eos": True}) for name in ("a", SERVED_NAME)}
    assert chat["a"].model == "a"
    assert chat["a"].choices[0].message.content != chat[SERVED_NAME].choices[0].message.content
    response = client.responses.create(model="b", input="Hello", max_output_tokens=3)
    assert response.model == "b"


def test_an_unknown_model_is_a_404_after_every_resolver_was_asked(client, http):
    with pytest.raises(openai.NotFoundError) as caught:
        _complete(client, "nowhere")
    assert "nowhere" in str(caught.value) and "Traceback" not in str(caught.value)
    records = {r["name"]: r for r in http.get("/v1/plugins").json()["data"]
               if r["group"] == "lora_resolvers" and r["process_role"] == "api-server"}
    assert records["raising"]["outcome"] == records["hanging"]["outcome"] == "registered"
    assert "the adapter store is down" in records["raising"]["runtime_error"]
    assert "longer than 0.5 s" in records["hanging"]["runtime_error"]
    assert records["Filesystem Resolver"]["distribution"] == "gateway-lora-filesystem-resolver"
    assert records["Filesystem Resolver"]["num_runtime_errors"] == 0


def test_the_example_resolver_finds_an_adapter_in_its_folder(client, http, tiny_model,
                                                             adapters):
    assert _complete(client, "found") == _expected(http, tiny_model, adapters["found"])
    assert "found" in {model.id for model in client.models.list()}


def test_adapters_load_and_unload_at_run_time(client, http, adapters):
    loaded = http.post("/v1/load_lora_adapter",
                       json={"lora_name": "d", "lora_path": str(adapters["d"])})
    assert loaded.status_code == 200, loaded.text
    assert _complete(client, "d") != _complete(client, SERVED_NAME)
    again = http.post("/v1/load_lora_adapter",
                      json={"lora_name": "d", "lora_path": str(adapters["d"])})
    assert again.status_code == 400 and "already been loaded" in again.text
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "d")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 404


@pytest.mark.parametrize(("adapter", "reason"), [
    ("rank16", "its rank 16 exceeds --max-lora-rank 8"),
    ("lm_head", "lm_head, which the model lacks"),
    ("missing", "has no readable adapter_config.json")])
def test_a_bad_adapter_is_a_400_naming_it_and_the_base_model_serves_on(client, http, adapters,
                                                                       adapter, reason):
    path = adapters.get(adapter, adapters["cache"] / "missing")
    answer = http.post("/v1/load_lora_adapter",
                       json={"lora_name": f"bad-{adapter}", "lora_path": str(path)})
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert f"LoRA adapter 'bad-{adapter}'" in message and reason in message
    assert _complete(client, SERVED_NAME)


def test_the_lora_info_gauge_names_max_loras(client, http):
    _complete(client, "a")
    metrics = http.get("/metrics").text
    [line] = [line for line in metrics.splitlines()
              if line.startswith("vllm:lora_requests_info{")]
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line


def test_a_bad_lora_module_stops_start_up_in_one_line(tiny_model, adapters):
    server = tiny_server(tiny_model, "--enable-lora", "--max-lora-rank", "8",
                         "--lora-modules", f"big={adapters['rank16']}")
    with pytest.raises(RuntimeError):
        server.start()
    log = server.log_text()
    assert "Cannot start: LoRA adapter 'big'" in log and "exceeds --max-lora-rank 8" in log
    assert "Traceback" not in log


def test_the_runtime_routes_are_absent_without_the_variable(monkeypatch):
    from fastapi.testclient import TestClient

    from gateway.frontend.app import build_app
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    app = build_app(serve_config("--enable-lora"), EngineInfo())  # type: ignore[arg-type]
    with TestClient(app) as test_client:
        answer = test_client.post("/v1/load_lora_adapter",
                                  json={"lora_name": "x", "lora_path": "/nowhere"})
    assert answer.status_code == 404
