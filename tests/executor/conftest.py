"""Fixtures of the executor tests: tiny random Llamas shaped to exercise every way the
model is split, the end-to-end fixtures of tests/entrypoints (the tiny model folder), and
one real local Ray cluster for the package's Ray tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.conftest import tiny_model  # noqa: F401
from tests.executor.ray_head import start_head, stop_cluster
from tests.tiny_model import build_tiny_llama


@pytest.fixture(scope="session")
def uneven_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 query heads on 3 KV heads (2 ranks hold 2 and 1), an odd intermediate size, a
    vocabulary that is not a multiple of 2, lm_head tied to the embedding, and biases on
    every projection."""
    return build_tiny_llama(tmp_path_factory.mktemp("uneven-llama"), vocab_size=301,
                            hidden_size=96, intermediate_size=129, num_attention_heads=6,
                            num_key_value_heads=3, tie_word_embeddings=True,
                            attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="package")
def ray_address() -> Iterator[str]:
    """The address of a local Ray cluster (ray_head.py), started once for the package."""
    # Its own short folder: Ray's socket paths must stay short, and pytest's base folders
    # may be cleaned by another pytest run while this one still uses it.
    temp_dir = Path(tempfile.mkdtemp(prefix="gw-ray-"))
    try:
        yield start_head(temp_dir)
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
