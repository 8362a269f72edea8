"""Fixtures of the executor tests: tiny random Llamas shaped to exercise every way the
model is split, the end-to-end fixtures of tests/frontend (the tiny model folder), and
one real local Ray cluster for the package's Ray tests."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import envs
from gateway.plugins import GENERAL_PLUGINS_GROUP
from tests.executor.ray_head import start_head, stop_cluster
from tests.frontend.conftest import tiny_model  # noqa: F401
from tests.plugin_dists import write_dist
from tests.tiny_model import build_tiny_llama

ROLE_PROBE_SOURCE = """
import os
from gateway.plugins.process import process_role

def register():
    with open(os.environ["GATEWAY_TEST_ROLE_PROBE_FILE"], "a") as log:
        log.write(f"{process_role()} {os.getpid()}\\n")
"""


@pytest.fixture(scope="module")
def probe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where probe_site's plugin writes "role pid" for each process that loads it (a server
    gets it as GATEWAY_TEST_ROLE_PROBE_FILE)."""
    return tmp_path_factory.mktemp("role-probe-out") / "probe.txt"


@pytest.fixture(scope="module")
def probe_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real distribution with one general plugin that records its process role and pid."""
    return write_dist(tmp_path_factory.mktemp("role-probe"), "role-probe",
                      {GENERAL_PLUGINS_GROUP: {"role_probe": "role_probe:register"}},
                      {"role_probe": ROLE_PROBE_SOURCE})


# These tests compare what several engines answer with what one engine answers, on tiny
# random models whose greedy choices include near ties. A request that happens to decode
# alone in one engine takes the lone decode's one C call
# (gateway/models/kernels/cpu/lone_decode.py), which equals the torch forward only to float32
# rounding and can flip such a tie; the tests are about routing and splitting, so every step
# here takes the torch forward (the call itself is tested against it in
# tests/models/kernels/cpu/test_lone_decode.py). The Ray head's processes get the same
# (ray_head.py).
ONE_PATH = {"GATEWAY_CPU_LONE_DECODE": "0"}


@pytest.fixture(scope="module", autouse=True)
def _torch_forward_only() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ONE_PATH.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def uneven_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 query heads on 3 KV heads (2 ranks hold 2 and 1), an odd intermediate size, a
    vocabulary that is not a multiple of 2, lm_head tied to the embedding, and biases on
    every projection."""
    return build_tiny_llama(tmp_path_factory.mktemp("uneven-llama"), vocab_size=301,
                            hidden_size=96, intermediate_size=129, num_attention_heads=6,
                            num_key_value_heads=3, tie_word_embeddings=True,
                            attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="package", autouse=True)
def _ray_home() -> Iterator[Path]:
    """A home folder of the package's own: Ray keeps its authentication token in
    ~/.ray/auth_token (and writes one when a local cluster starts), so the tests neither
    read nor leave one in the user's home. The token is made first: the package's head then
    runs with token authentication, Ray's default for clusters, and every server that
    joins it must present the token (gateway/ray_cluster.py)."""
    home = Path(tempfile.mkdtemp(prefix="gw-ray-home-"))
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GATEWAY_CACHE_DIR", envs.cache_dir())  # the built kernels, reused
        patch.setenv("HOME", str(home))
        yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="package")
def ray_head(_ray_home: Path) -> Iterator[tuple[str, Path]]:
    """The address and session folder of a local Ray cluster (ray_head.py), started once
    for the package."""
    # Its own short folder: Ray's socket paths must stay short, and pytest's base folders
    # may be cleaned by another pytest run while this one still uses it.
    temp_dir = Path(tempfile.mkdtemp(prefix="gw-ray-"))
    try:
        yield start_head(temp_dir), temp_dir
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="package")
def ray_address(ray_head: tuple[str, Path]) -> str:
    return ray_head[0]
