"""Rope scaling ("yarn", "dynamic", "longrope") equals transformers': the frequencies and
attention factor of its own rope init functions, the cos/sin tables at positions past the
original context, and the logits of tiny random Qwen2 (yarn), Llama (dynamic) and Phi-3
(longrope, partial rotary as Phi-4-mini) models at such positions. "dynamic" is vLLM's
fixed table (the base of original * factor positions), equal to transformers' at that
length; "longrope" takes its long factors when the served context passes the original."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.models.info.decoder_config import (
    UnsupportedConfigError,
    read_decoder_config,
    rope_context_length,
)
from gateway.models.layers.rotary import RotaryEmbedding, rope_frequencies
from tests.models.test_llama import GREEDY, TOLERANCE, _check_step, _worker
from tests.tiny_model import build_tiny_decoder, build_tiny_llama

_BASE = {"vocab_size": 32, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
         "rope_theta": 10000.0}
_LONG = [1.0 + 0.5 * i for i in range(16)]  # 32 rotated dims: 16 factors each
_SHORT = [1.0 + 0.05 * i for i in range(16)]
# case -> (architecture, config changes, the sequence length transformers computes for)
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "yarn": ("Qwen2ForCausalLM", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}, 64),
    "yarn-beta-truncate": ("Qwen2ForCausalLM", {"rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 16, "beta_slow": 2, "truncate": False}}, 64),
    "yarn-attention-factor": ("LlamaForCausalLM", {"rope_scaling": {
        "type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
        "attention_factor": 0.8}}, 64),
    "yarn-mscale": ("LlamaForCausalLM", {"rope_theta": 50000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.5}}, 64),
    "dynamic": ("LlamaForCausalLM", {"max_position_embeddings": 16, "rope_scaling": {
        "rope_type": "dynamic", "factor": 3.0}}, 48),
    "longrope-long": ("Phi3ForCausalLM", {
        "original_max_position_embeddings": 16,
        "rope_scaling": {"type": "longrope", "short_factor": _SHORT, "long_factor": _LONG}}, 64),
    "longrope-short": ("Phi3ForCausalLM", {
        "max_position_embeddings": 16, "original_max_position_embeddings": 16,
        "rope_scaling": {"type": "longrope", "short_factor": _SHORT, "long_factor": _LONG}}, 16),
    "longrope-factors": ("LlamaForCausalLM", {
        "rope_scaling": {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG,
                         "original_max_position_embeddings": 8, "factor": 4.0,
                         "attention_factor": 1.3}}, 64),
}


def _transformers_rope(architecture: str, config: dict[str, Any],
                       seq_len: int) -> tuple[torch.Tensor, float]:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    family = architecture.removesuffix("ForCausalLM")
    hf_config = getattr(transformers, f"{family}Config")(**config)
    rope_type = hf_config.rope_parameters["rope_type"]
    inv_freq, attention = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len)
    return inv_freq, float(attention)


@pytest.mark.parametrize("case", CASES)
def test_frequencies_and_tables_equal_transformers_past_the_original_context(case: str) -> None:
    architecture, changes, seq_len = CASES[case]
    raw = {**_BASE, **changes}
    config = read_decoder_config(architecture, raw)
    expected_freq, expected_attention = _transformers_rope(architecture, raw, seq_len)
    max_positions = max(config.max_position_embeddings, config.context_length)
    inv_freq, attention = rope_frequencies(config.head_dim, config.rope_theta,
                                           config.rope_scaling, max_positions=max_positions)
    torch.testing.assert_close(inv_freq, expected_freq.float(), rtol=1e-6, atol=0)
    assert attention == pytest.approx(expected_attention, rel=1e-7)
    rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                             config.rope_scaling)
    positions = torch.arange(max_positions // 2, max_positions)  # past the original context
    cos, sin = rotary(positions, torch.float32)
    angles = torch.outer(positions.float(), expected_freq.float())
    torch.testing.assert_close(cos[:, 0, :16], angles.cos() * expected_attention, atol=2e-5,
                               rtol=0)
    torch.testing.assert_close(sin[:, 0, 16:], angles.sin() * expected_attention, atol=2e-5,
                               rtol=0)
    assert (attention == 1.0) == case.startswith(("dynamic", "longrope-short"))


@pytest.mark.parametrize(("changes", "length"), [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 32768},
      "max_position_embeddings": 32768}, 131072),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 8192),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 8192),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
      "original_max_position_embeddings": 1024}, 4096),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 4096),
    ({"model_type": "gemma3_text", "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, 4096),
])
def test_the_served_context_is_vllms(changes: dict[str, Any], length: int) -> None:
    assert rope_context_length({"max_position_embeddings": 4096, **changes}) == length


@pytest.mark.parametrize(("scaling", "message"), [
    ({"rope_type": "yarn", "original_max_position_embeddings": 16}, "needs the field 'factor'"),
    ({"rope_type": "dynamic", "factor": 2.0, "alpha": 1000.0}, "alpha=1000.0 is not supported"),
    ({"rope_type": "yarn", "factor": 2.0, "attn_factor": 0.9}, "attn_factor=0.9"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [1.0] * 16,
      "long_mscale": 1.2}, "long_mscale=1.2 is not supported with rope type 'longrope'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 16}, "needs the field 'long_factor'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 15, "long_factor": [1.0] * 16},
     "short_factor has 15 values; the rotary dims need 16"),
    ({"rope_type": "mrope", "mrope_section": [8, 4, 4]}, "rope scaling type 'mrope'"),
])
def test_an_incomplete_scaling_is_refused_by_name(scaling: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=message):
        read_decoder_config("LlamaForCausalLM", {**_BASE, "rope_scaling": scaling})


# ------------------------------------------------------------------ through the model
def _reference(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _run(model: Path, prompts: list[int], num_decodes: int,
         max_model_len: int | None = None, reference_folder: Path | None = None) -> int:
    """Prompts of these lengths prefilled together, then decoded; each sampled row's
    logits equal transformers' (on `reference_folder`, default `model`) on the same tokens."""
    reference = _reference(reference_folder or model)
    worker, driver, captured = _worker(model, max_model_len=max_model_len)
    generator = torch.Generator().manual_seed(1)
    for i, length in enumerate(prompts):
        tokens = torch.randint(3, worker.vocab_size, (length,), generator=generator).tolist()
        driver.add(f"r{i}", tokens, GREEDY)
    return sum(_check_step(driver, driver.step(256), captured, reference, TOLERANCE)
               for _ in range(1 + num_decodes))


def test_a_yarn_qwen2_equals_transformers_past_the_original_context(tmp_path: Path) -> None:
    model = build_tiny_decoder(tmp_path / "yarn", "Qwen2ForCausalLM", max_position_embeddings=16,
                               rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 16})
    assert _run(model, [5, 30, 50], num_decodes=6) == 21  # up to position 56 of 64


def test_a_dynamic_llama_equals_transformers_at_the_scaled_length(tmp_path: Path) -> None:
    """transformers recomputes the base for the sequence's length; at original * factor it
    is the base of vLLM's (and the gateway's) fixed table."""
    model = build_tiny_llama(tmp_path / "dynamic", max_position_embeddings=16,
                             rope_scaling={"rope_type": "dynamic", "factor": 3.0})
    assert _run(model, [48], num_decodes=0) == 1


@pytest.mark.parametrize(("max_model_len", "prompts"), [(None, [20, 40]), (16, [6, 12])])
def test_a_longrope_phi3_equals_transformers(tmp_path: Path, max_model_len: int | None,
                                             prompts: list[int]) -> None:
    """Long factors when the served context passes the original 16 positions, and
    transformers' sequences are longer than that; short ones when it is served with 16."""
    pairs = 4  # head dim 16, half of it rotated (as Phi-4-mini rotates part of its heads)
    model = build_tiny_decoder(
        tmp_path / "longrope", "Phi3ForCausalLM", max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.5],
                      "long_factor": [1.5, 3.0, 7.0, 12.0][:pairs]})
    assert _run(model, prompts, num_decodes=3, max_model_len=max_model_len) == 8
    config = read_decoder_config("Phi3ForCausalLM", {
        **_BASE, "max_position_embeddings": 64, "original_max_position_embeddings": 16,
        "rope_scaling": {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG}})
    assert config.rope_scaling is not None
    assert config.rope_scaling["factor"] == 4.0
    assert math.isclose(rope_frequencies(32, 1e4, config.rope_scaling, max_positions=64)[1],
                        math.sqrt(1 + math.log(4) / math.log(16)))


_YARN_GGUF = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
              "llama.rope.scaling.original_context_length": 16,
              "llama.rope.scaling.yarn_beta_fast": 16.0, "llama.rope.scaling.yarn_beta_slow": 2.0}


def test_a_yarn_gguf_equals_transformers_on_its_hf_folder(tmp_path: Path) -> None:
    """llama.cpp's rope.scaling keys read as the HF config's rope_scaling."""
    from tests.models.tiny_gguf import write_tiny_gguf

    folder = build_tiny_llama(tmp_path / "hf", max_position_embeddings=16, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 16.0, "beta_slow": 2.0})
    model = write_tiny_gguf(folder, tmp_path / "yarn.gguf", metadata=_YARN_GGUF)
    assert _run(model, [9, 40], num_decodes=4, reference_folder=folder) == 10


def test_a_gguf_yarn_attention_factor_is_refused_by_name(tmp_path: Path) -> None:
    """llama.cpp multiplies its yarn_attn_factor into the mscale; transformers' replaces it:
    a file that sets one is refused, not read either way."""
    from gateway.models.info.paths import read_model_info
    from gateway.models.info.support import UnsupportedModelError, check_supported
    from tests.models.tiny_gguf import write_tiny_gguf

    folder = build_tiny_llama(tmp_path / "hf", max_position_embeddings=16)
    model = write_tiny_gguf(folder, tmp_path / "attn.gguf", metadata={
        **_YARN_GGUF, "llama.rope.scaling.yarn_attn_factor": 0.5})
    info = read_model_info(str(model))
    assert info.max_model_len == 64
    with pytest.raises(UnsupportedModelError, match=r"rope_scaling: attn_factor=0\.5"):
        check_supported(info)


def test_a_lone_yarn_decode_in_one_c_call_equals_transformers(tmp_path: Path) -> None:
    """A Llama decoding alone takes the CPU's one C call, which reads the same (scaled)
    cos/sin tables as the torch forward."""
    model = build_tiny_llama(tmp_path / "yarn", max_position_embeddings=16, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    reference = _reference(model)
    worker, driver, captured = _worker(model)
    runner = worker.model_runner
    assert runner is not None and runner.lone_decode is not None
    forwards: list[int] = []  # the steps that ran the torch forward
    runner.model.register_forward_pre_hook(  # type: ignore[attr-defined]
        lambda *_: forwards.append(1))
    driver.add("a", list(range(3, 23)), GREEDY)
    checked = sum(_check_step(driver, driver.step(64), captured, reference, TOLERANCE)
                  for _ in range(12))
    assert checked == 12 and len(forwards) == 1  # the prompt; 11 decodes past position 20


@pytest.mark.e2e
def test_a_yarn_model_served_end_to_end_has_vllms_context_and_transformers_answer(
        tmp_path: Path) -> None:
    """The real server on a tiny yarn Qwen2 of 16 original positions: its context is
    original * factor, and a greedy completion running past position 16 is transformers'."""
    import httpx

    from tests.frontend.conftest import SERVED_NAME
    from tests.server import ServerProcess

    model = build_tiny_decoder(tmp_path / "yarn", "Qwen2ForCausalLM", max_position_embeddings=16,
                               rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 16})
    with ServerProcess([str(model), "--served-model-name", SERVED_NAME, "--kv-cache-memory",
                        "64MiB"], log_path=tmp_path / "server.log") as server:
        served = httpx.get(server.url("/v1/models"), timeout=30).json()["data"][0]
        answer = httpx.post(server.url("/v1/completions"), timeout=60, json={
            "model": SERVED_NAME, "prompt": "Once upon a time there was a server",
            "max_tokens": 30, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert served["max_model_len"] == 64
    assert answer.status_code == 200, answer.text
    body = answer.json()
    prompt = body["choices"][0]["prompt_token_ids"]
    with torch.no_grad():
        expected = _reference(model).generate(torch.tensor([prompt]), max_new_tokens=30,
                                              min_new_tokens=30, do_sample=False)
    assert len(prompt) + 30 > 32
    assert body["choices"][0]["token_ids"] == expected[0, len(prompt):].tolist()
