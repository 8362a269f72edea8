from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.plugins import loader
from tests.plugin_dists import subprocess_env


@pytest.fixture(autouse=True)
def _fresh_plugin_state(monkeypatch: pytest.MonkeyPatch):
    """Each test starts with no allowlist, an empty report and a fresh discovery scan."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    loader.reset_for_tests()
    from gateway import platforms
    platforms.reset_for_tests()
    yield
    loader.reset_for_tests()
    platforms.reset_for_tests()


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A folder to write fake installed distributions into."""
    root = tmp_path / "site"
    root.mkdir()
    return root


def run_python(code: str, *roots: Path, timeout: float = 120, **env: str,
               ) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter that sees the distributions under `roots`."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env(*roots, **env), timeout=timeout)


def run_gateway(*args: str, roots: tuple[Path, ...] = (), timeout: float = 120,
                **env: str) -> subprocess.CompletedProcess[str]:
    """Run the `gateway` command in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "gateway.frontend.cli.main", *args],
                          capture_output=True, text=True, env=subprocess_env(*roots, **env),
                          timeout=timeout)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama HF folder (built once per test session)."""
    from tests.tiny_model import build_tiny_llama
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def gguf_pair():  # type: ignore[no-untyped-def]
    """(ours, transformers') tokenizer of the default model's GGUF (read once per session)."""
    from transformers import AutoTokenizer

    from gateway.models.info.paths import default_model_path
    from gateway.tokenizer import load_tokenizer
    path = default_model_path()
    return load_tokenizer(None), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def folder_pair(tiny_llama: Path):  # type: ignore[no-untyped-def]
    """(ours, transformers') tokenizer of the tiny Llama HF folder."""
    from transformers import AutoTokenizer

    from gateway.tokenizer import load_tokenizer
    return load_tokenizer(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def http(server):  # type: ignore[no-untyped-def]
    """An httpx client of the module's `server` (each end-to-end module starts its own)."""
    with httpx.Client(base_url=server.url(), timeout=120) as client:
        yield client


@pytest.fixture
def exact_float32_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantized CPU products in exact float32 (GATEWAY_CPU_INT8_ACTIVATIONS=0), for the
    tests that compare them with the dequantized weights' products to float32 precision;
    quant_int8's own tests hold the 8-bit activations to theirs."""
    monkeypatch.setenv("GATEWAY_CPU_INT8_ACTIVATIONS", "0")
