"""A Hugging Face repo id served by the real server from a cache folder the test builds,
offline (HF_HUB_OFFLINE=1): the id is the served name and the model answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.frontend.conftest import TINY_FLAGS
from tests.models.hf_cache import add_folder_to_hf_cache
from tests.plugin_dists import subprocess_env
from tests.server import ServerProcess

REPO_ID = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cache = tmp_path_factory.mktemp("hf-home") / "hub"
    add_folder_to_hf_cache(cache, REPO_ID, tiny_model)
    env = subprocess_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    flags = [f for f in TINY_FLAGS if f not in ("--served-model-name", "tiny")]
    with ServerProcess([REPO_ID, *flags], env=env) as process:
        yield process


def test_a_cached_repo_id_is_served_under_its_id(server: ServerProcess) -> None:
    models = httpx.get(server.url("/v1/models"), timeout=30).json()
    assert [m["id"] for m in models["data"]] == [REPO_ID]
    response = httpx.post(server.url("/v1/completions"), timeout=60, json={
        "model": REPO_ID, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
