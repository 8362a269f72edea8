"""The example distributions of general_plugins/, platform_plugins/ and logits_processors/,
pip-installed as a user would, served by one real server with -tp 2 (two worker processes).

Also the worker's load order (issue 13, item 2): a probe general plugin records, in each
process, whether torch.distributed was already initialised when it ran.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.plugins import DEFAULT_PLUGINS_GROUP, LOGITS_PROCESSORS_GROUP, PLATFORM_PLUGINS_GROUP
from tests.frontend.conftest import REPO, tiny_server
from tests.plugin_dists import write_dist
from tests.server import ServerProcess
from tests.tiny_model import build_tiny_llama

EXAMPLES = ("general_plugins/oot_model", "platform_plugins/example_platform",
            "logits_processors/ban_tokens")
ROLES = ["api-server", "engine-core", "worker-0", "worker-1"]
ORDER_PROBE = """
    import os, sys
    def probe():
        from gateway.plugins import this_process
        dist = sys.modules.get("torch.distributed")
        joined = bool(dist and dist.is_available() and dist.is_initialized())
        with open(os.environ["ORDER_PROBE"], "a") as f:
            f.write(f"{this_process().role} {joined}\\n")
"""


@pytest.fixture(scope="module")
def examples_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("examples")
    sources = tmp_path_factory.mktemp("example-sources")
    folders = [str(shutil.copytree(REPO / folder, sources / Path(folder).name))
               for folder in EXAMPLES]  # copies: the build leaves nothing in the repository
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(target), *folders], check=True, capture_output=True, timeout=300)
    return write_dist(target, "order-probe",
                      {DEFAULT_PLUGINS_GROUP: {"order": "order_probe:probe"}},
                      {"order_probe": ORDER_PROBE})


@pytest.fixture(scope="module")
def oot_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, its config naming the example's out-of-tree architecture."""
    folder = build_tiny_llama(tmp_path_factory.mktemp("oot-model"))
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GatewayOotForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def order_probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("probe") / "order.txt"


@pytest.fixture(scope="module")
def server(examples_site: Path, oot_model: Path, order_probe: Path) -> Iterator[ServerProcess]:
    with tiny_server(oot_model, "-tp", "2", roots=(examples_site,),
                     GATEWAY_EXAMPLE_PLATFORM="1", ORDER_PROBE=str(order_probe)) as running:
        yield running


@pytest.fixture(scope="module")
def records(http: httpx.Client) -> list[dict]:
    return http.get("/v1/plugins").json()["data"]


def _outcomes(records: list[dict], group: str, name: str) -> dict[str, str]:
    return {r["process_role"]: r["outcome"] for r in records
            if r["group"] == group and r["name"] == name}


def _complete(http: httpx.Client, **fields) -> httpx.Response:
    return http.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 3,
                                              "temperature": 0, "ignore_eos": True, **fields})


def test_the_out_of_tree_architecture_is_served_end_to_end(http, records):
    answer = _complete(http)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3
    assert _outcomes(records, DEFAULT_PLUGINS_GROUP, "oot_model") == dict.fromkeys(ROLES, "called")


def test_the_example_platform_is_active_in_every_process(records):
    assert _outcomes(records, PLATFORM_PLUGINS_GROUP, "example_platform") == \
        dict.fromkeys(ROLES, "active")
    details = {r["detail"] for r in records if r["name"] == "example_platform"}
    assert details == {"gateway_example_platform.platform:ExamplePlatform"}


def test_the_logits_processor_runs_in_each_worker_and_changes_the_output(http, records):
    loaded = _outcomes(records, LOGITS_PROCESSORS_GROUP, "ban_tokens")
    assert loaded["worker-0"] == loaded["worker-1"] == "loaded"
    assert "api-server" not in loaded  # the front end never imports it
    [engine_core] = [r for r in records if r["name"] == "ban_tokens"
                     and r["process_role"] == "engine-core"]
    assert "validate_params only" in engine_core["detail"]
    kept = http.post("/tokenize", json={"prompt": "fox", "add_special_tokens": False}
                     ).json()["tokens"][0]
    banned = [t for t in range(512) if t != kept]
    expected = http.post("/detokenize", json={"tokens": [kept] * 3}).json()["prompt"]
    plain = _complete(http).json()["choices"][0]["text"]
    forced = _complete(http, vllm_xargs={"banned_token_ids": banned})
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["text"] == expected != plain


@pytest.mark.parametrize("bad", [[-1], "42", [True]])
def test_a_bad_banned_list_is_a_400_naming_extra_args(http, bad):
    answer = _complete(http, vllm_xargs={"banned_token_ids": bad})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "extra_args"


def test_each_worker_loads_the_general_plugins_before_joining_its_ranks(http, order_probe):
    lines = dict(line.split() for line in order_probe.read_text().splitlines())
    assert lines == {"api-server": "False", "engine-core": "False", "worker-0": "False",
                     "worker-1": "False"}
