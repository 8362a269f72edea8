"""Fixtures of the front-end tests: fake endpoint plugins, the app without an engine, and
(for the end-to-end tests) a tiny random Llama model folder and real server processes."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gateway.config import EngineConfig, ModelConfig
from gateway.frontend.cli.args import add_server_args, server_config_from_args
from gateway.frontend.engine_client.errors import EngineDeadError
from gateway.frontend.server_config import ServerConfig
from tests.frontend.fake_endpoints import MODULE, write_fake_endpoints
from tests.plugin_dists import activate, forget_modules, subprocess_env
from tests.server import ServerProcess


@dataclass
class EngineInfo:
    """An engine client with no engine: what the app reads while it is built and what the
    probes and metrics read, and no more: its requests never reach an engine (`generate`
    and `encode` refuse). For tests of the app's shape (routes, plugins, auth, errors);
    everything that generates runs against the real server in the e2e tests."""

    supported_tasks: tuple[str, ...] = ("generate",)
    model_name: str = "tiny-model"
    max_model_len: int = 128
    is_dead: bool = False
    dead_reason: str | None = None
    config: EngineConfig = field(default_factory=EngineConfig)
    records: list[dict[str, Any]] = field(default_factory=list)
    tokenizer: Any = None
    model_info: Any = None
    num_kv_blocks: int = 0
    stalled_reason: str | None = None
    num_inflight_requests: int = 0
    process_pids: dict[str, int] = field(default_factory=dict)
    gc_stats_dirs: list[str] = field(default_factory=list)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    def plugin_reports(self) -> list[dict[str, Any]]:
        return list(self.records)

    async def generate(self, prompt_token_ids, params, request_id):
        raise EngineDeadError("no engine in this test")
        yield  # an async generator, as the real one

    async def encode(self, prompt_token_ids, params, request_id):
        raise EngineDeadError("no engine in this test")

    async def abort(self, request_id: str) -> None:
        pass

    def add_parent_request(self, child_request_ids: list[str]) -> None:
        pass

    def reserve(self, request_ids: list[str]) -> None:
        pass

    def release(self, request_ids: list[str]) -> None:
        pass

    def add_outputs_listener(self, callback) -> None:
        pass

    def add_death_listener(self, callback) -> None:
        pass

    def add_request_hook(self, hook) -> None:
        pass

    def add_rejection_listener(self, callback) -> None:
        pass

    def fail_requests(self, error: BaseException) -> int:
        return 0

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self.is_dead, self.dead_reason = True, "shut down"


def serve_args(*argv: str) -> argparse.Namespace:
    """Parsed `gateway serve` flags."""
    return add_server_args(argparse.ArgumentParser()).parse_args(list(argv))


def serve_config(*argv: str) -> ServerConfig:
    """The server configuration of `gateway serve` with these flags."""
    return server_config_from_args(serve_args(*argv))


@pytest.fixture
def fake_endpoints(site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The fake endpoint-plugin distribution, installed (on sys.path) for this test."""
    write_fake_endpoints(site)
    activate(site, monkeypatch)
    yield site
    forget_modules(MODULE)


# ------------------------------------------------------------------ end to end
REPO = Path(__file__).resolve().parents[2]
EXAMPLE_PLUGINS = ("summarize", "server_info", "dedupe")  # folders under endpoint_plugins/
EXAMPLE_IO_PROCESSORS = ("semantic_search",)  # folders under io_processors/
SERVED_NAME = "tiny"
#: Flags of every tiny-model server: a small context and KV budget keep start-up fast.
TINY_FLAGS = ("--served-model-name", SERVED_NAME, "--max-model-len", "2048",
              "--kv-cache-memory", "64MiB", "--disable-uvicorn-access-log")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama HF folder (built once per session; see tests/tiny_model.py)."""
    from tests.tiny_model import build_tiny_llama
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def fake_endpoints_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake endpoint-plugin distribution in a folder for server subprocesses."""
    return write_fake_endpoints(tmp_path_factory.mktemp("fake-endpoints"))


@pytest.fixture(scope="session")
def example_plugins_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example plugins of endpoint_plugins/ and io_processors/, pip-installed as a user
    would (into a target folder, so the test environment itself is not changed)."""
    import shutil
    import subprocess
    import sys

    target = tmp_path_factory.mktemp("example-plugins")
    sources = tmp_path_factory.mktemp("example-plugin-sources")
    folders = []  # copies, so that the build leaves nothing in the repository
    examples = [("endpoint_plugins", name) for name in EXAMPLE_PLUGINS]
    examples += [("io_processors", name) for name in EXAMPLE_IO_PROCESSORS]
    for kind, name in examples:
        folders.append(str(shutil.copytree(REPO / kind / name, sources / name)))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(target), *folders], check=True, capture_output=True, timeout=300)
    return target


def tiny_server(model: Path, *flags: str, roots: tuple[Path, ...] = (),
                log_path: Path | None = None, **env: str) -> ServerProcess:
    """A (not yet started) `gateway serve` of the tiny model that sees the plugin
    distributions under `roots`; `env` adds variables (VLLM_PLUGINS, ...)."""
    environment = subprocess_env(*roots, **env)
    if "VLLM_API_KEY" not in env:
        environment.pop("VLLM_API_KEY", None)
    return ServerProcess([str(model), *TINY_FLAGS, *flags], env=environment, log_path=log_path)
