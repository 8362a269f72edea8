"""Hugging Face repo ids as model names: parsed as vLLM spells them, found in a cache folder
the test builds (no network), a GGUF repo's quantisation picked, and one-line errors that
name the id, the cache and how to fetch it when it is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ModelConfig, SpeculativeConfig
from gateway.models.info.hf_resolve import (
    HFModelRef,
    ModelNotFoundError,
    hub_cache_dir,
    parse_hf_model_ref,
)
from gateway.models.info.paths import (
    default_model_path,
    fetch_draft_model,
    fetch_model_config,
    resolve_model_path,
)
from tests.models.hf_cache import add_to_hf_cache

CONFIG = '{"architectures": ["LlamaForCausalLM"]}'
FOLDER: dict[str, bytes | str | Path] = {"config.json": CONFIG, "model.safetensors": b""}
QUANTS = {"tiny-F32.gguf": b"GGUF f32", "tiny-Q8_0.gguf": b"GGUF q8",
          "tiny.Q4_K_M.gguf": b"GGUF q4",
          "big/big-Q8_0-00001-of-00002.gguf": b"GGUF part"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF cache that huggingface_hub's rules point at, and no network."""
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


@pytest.mark.parametrize(("name", "expected"), [
    ("Qwen/Qwen2.5-0.5B-Instruct", HFModelRef("Qwen/Qwen2.5-0.5B-Instruct")),
    ("unsloth/Qwen3-0.6B-GGUF:Q4_K_M", HFModelRef("unsloth/Qwen3-0.6B-GGUF", quant="Q4_K_M")),
    ("org/repo/sub/model-Q8_0.gguf", HFModelRef("org/repo", filename="sub/model-Q8_0.gguf")),
    ("./org/name", None), ("/models/org/name", None), ("~/org/name", None),
    ("no-owner", None), ("org/name/config.json", None), ("org/name/../x.gguf", None),
    ("org/na me", None), ("a/b/c", None),
])
def test_repo_ids_are_parsed_as_vllm_spells_them(name: str, expected: HFModelRef | None) -> None:
    assert parse_hf_model_ref(name) == expected


@pytest.mark.parametrize(("env", "download_dir", "expected"), [
    ({"HF_HUB_CACHE": "/c/hub", "HF_HOME": "/h"}, None, "/c/hub"),
    ({"HF_HOME": "/h"}, None, "/h/hub"),
    ({"XDG_CACHE_HOME": "/x"}, None, "/x/huggingface/hub"),
    ({"HF_HUB_CACHE": "/c/hub"}, "/d", "/d"),
])
def test_cache_folder_follows_huggingface_hub_rules(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], download_dir: str | None,
        expected: str) -> None:
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    assert hub_cache_dir(download_dir) == Path(expected)


def test_cached_folder_repo_resolves_to_its_snapshot(cache: Path) -> None:
    snapshot = add_to_hf_cache(cache, "org/tiny", FOLDER)
    assert resolve_model_path("org/tiny") == snapshot
    fetched = fetch_model_config(ModelConfig(model="org/tiny"))
    assert (fetched.model, fetched.served_model_name) == (str(snapshot), "org/tiny")


def test_a_draft_model_repo_resolves_to_its_snapshot_in_the_served_model_cache(
        cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    snapshot = add_to_hf_cache(other, "org/draft", FOLDER)
    draft = SpeculativeConfig(method="draft_model", model="org/draft",
                              num_speculative_tokens=3)
    fetched = fetch_draft_model(draft, ModelConfig(model="org/tiny", download_dir=str(other)))
    assert fetched == SpeculativeConfig(method="draft_model", model=str(snapshot),
                                        num_speculative_tokens=3)
    with pytest.raises(ModelNotFoundError, match="field 'model' \\(the draft model\\)"):
        fetch_draft_model(draft, ModelConfig(model="org/tiny"))  # not in HF_HUB_CACHE
    missing = SpeculativeConfig(method="draft_model", model=str(tmp_path / "nowhere"),
                                num_speculative_tokens=3)
    with pytest.raises(FileNotFoundError, match="field 'model' .*nowhere"):
        fetch_draft_model(missing, ModelConfig())  # a path: refused now, not in the worker
    ngram = SpeculativeConfig(num_speculative_tokens=3)
    assert fetch_draft_model(ngram, ModelConfig()) is ngram


@pytest.mark.parametrize(("name", "member"), [
    ("org/tiny-GGUF:Q8_0", "tiny-Q8_0.gguf"), ("org/tiny-GGUF:q8_0", "tiny-Q8_0.gguf"),
    ("org/tiny-GGUF:F32", "tiny-F32.gguf"), ("org/tiny-GGUF:Q4_K_M", "tiny.Q4_K_M.gguf"),
    ("org/tiny-GGUF/tiny-F32.gguf", "tiny-F32.gguf"),
])
def test_gguf_quantisation_is_picked_from_the_repo(cache: Path, name: str, member: str) -> None:
    snapshot = add_to_hf_cache(cache, "org/tiny-GGUF", QUANTS)
    path = resolve_model_path(name)
    assert path == snapshot / member
    assert path.read_bytes() == QUANTS[member]  # the snapshot's link leads to its blob


def test_a_repo_of_several_ggufs_needs_a_quantisation(cache: Path) -> None:
    add_to_hf_cache(cache, "org/tiny-GGUF", QUANTS)
    with pytest.raises(ModelNotFoundError, match=r"holds 4 GGUF files: pick one as "
                       r"org/tiny-GGUF:QUANT .*tiny-F32\.gguf, tiny-Q8_0\.gguf"):
        resolve_model_path("org/tiny-GGUF")


def test_a_split_gguf_is_refused(cache: Path) -> None:
    add_to_hf_cache(cache, "org/big", {"big-Q8_0-00001-of-00002.gguf": b"GGUF"})
    with pytest.raises(ModelNotFoundError, match="one part of a split GGUF"):
        resolve_model_path("org/big:Q8_0")


def test_a_snapshot_of_only_config_json_is_not_a_cached_model(cache: Path) -> None:
    """What a config look-up leaves in the cache: the weights would still be missing."""
    add_to_hf_cache(cache, "org/tiny", {"config.json": CONFIG})
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        fetch_model_config(ModelConfig(model="org/tiny"))


def test_a_repo_of_one_gguf_needs_no_quantisation(cache: Path) -> None:
    snapshot = add_to_hf_cache(cache, "org/one", {"one-Q8_0.gguf": b"GGUF", "README.md": "hi"})
    assert resolve_model_path("org/one") == snapshot / "one-Q8_0.gguf"


def test_revision_names_a_branch_or_a_commit(cache: Path) -> None:
    main = add_to_hf_cache(cache, "org/tiny", FOLDER)
    v2 = add_to_hf_cache(cache, "org/tiny", FOLDER, revision="v2",
                         commit="c" * 40)
    assert resolve_model_path("org/tiny") == main
    assert resolve_model_path("org/tiny", revision="v2") == v2
    assert resolve_model_path("org/tiny", revision="c" * 40) == v2
    with pytest.raises(ModelNotFoundError, match=r"'org/tiny' \(revision v3\)"):
        fetch_model_config(ModelConfig(model="org/tiny", revision="v3"))


def test_download_dir_is_the_cache_looked_in(cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    snapshot = add_to_hf_cache(other, "org/tiny", FOLDER)
    fetched = fetch_model_config(ModelConfig(model="org/tiny", download_dir=str(other)))
    assert fetched.model == str(snapshot)
    with pytest.raises(ModelNotFoundError):
        fetch_model_config(ModelConfig(model="org/tiny"))  # not in HF_HUB_CACHE


def test_missing_model_offline_says_the_id_the_cache_and_how_to_fetch(cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as caught:
        fetch_model_config(ModelConfig(model="org/absent:Q4_K_M", revision="v1"))
    message = str(caught.value)
    assert "\n" not in message
    assert f"'org/absent:Q4_K_M' (revision v1) is not a local path and not in the Hugging " \
           f"Face cache {cache} and HF_HUB_OFFLINE is set" in message
    assert "`hf download org/absent --include '*Q4_K_M*.gguf' --revision v1`" in message


def test_a_packaged_model_id_needs_no_cache(cache: Path) -> None:
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == default_model_path()


def test_local_paths_and_none_are_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / "org" / "name"
    folder.mkdir(parents=True)
    for model in (None, str(folder)):
        assert fetch_model_config(ModelConfig(model=model)) == ModelConfig(model=model)


def test_serve_of_an_unreachable_hub_fails_in_one_line(tmp_path: Path) -> None:
    """Not cached, online, but the Hub cannot be reached: exit 1 with one error line."""
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_ENDPOINT": "http://127.0.0.1:9", "VLLM_PLUGINS": ""}
    result = subprocess.run(
        [sys.executable, "-m", "gateway.frontend.cli.main", "serve", "org/absent"],
        capture_output=True, text=True, timeout=120, env=env)
    errors = [line for line in result.stderr.splitlines() if "Cannot start" in line]
    assert result.returncode == 1, result.stderr
    assert len(errors) == 1, result.stderr
    assert "'org/absent' (revision main) is not a local path and not in the Hugging Face " \
           f"cache {tmp_path / 'hub'} and cannot be downloaded (" in errors[0]
    assert "`hf download org/absent`" in errors[0]


def test_revision_and_download_dir_flags_reach_the_model_config() -> None:
    import argparse

    from gateway.frontend.cli.args import add_server_args, engine_config_from_args

    args = add_server_args(argparse.ArgumentParser()).parse_args(
        ["org/name:Q8_0", "--revision", "v2", "--download-dir", "/models/hf"])
    model = engine_config_from_args(args).model
    assert (model.model, model.revision, model.download_dir) == ("org/name:Q8_0", "v2",
                                                                 "/models/hf")
