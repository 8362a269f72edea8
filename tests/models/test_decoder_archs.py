"""Each decoder family beyond Llama equals transformers' own model (float32, within 1e-4)
at every step of a mixed batch (chunked prefills beside decodes, requests joining,
finishing and being preempted), on a tiny random model of that family built here: sliding
windows (Mistral; Qwen3's upper layers; Gemma 3's alternating ones, with their own rope
base), q/k/v biases (Qwen2), q/k norms (Qwen3, Gemma 3), Gemma's norms, embedding scale,
query scale and logit soft-capping, Phi-3's fused checkpoint and partial rotary. Every
family is the one decoder (archs/decoder.py) under its HF name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.test_llama import GREEDY, TOLERANCE, _check_step, _worker
from tests.tiny_model import DECODER_FAMILIES, build_tiny_decoder

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths

ARCHITECTURES = sorted(DECODER_FAMILIES)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoders")
    return {arch: build_tiny_decoder(root / arch, arch) for arch in ARCHITECTURES}


def _reference(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _short_mixed_run(model: Path, reference) -> int:  # type: ignore[no-untyped-def]
    """test_llama's mixed batch, shorter: fresh prompts and continued chunks longer than
    the windows, decodes on both attention paths (a few sequences, then four or more), a
    preempted request recomputed, a lone decode; every sampled row is checked."""
    worker, driver, captured = _worker(model)
    generator = torch.Generator().manual_seed(0)
    prompts = {f"r{i}": torch.randint(3, worker.vocab_size, (n,), generator=generator).tolist()
               for i, n in enumerate([3, 17, 29, 20, 5, 5])}
    checked = 0

    def step(budget: int = 32, only: list[str] | None = None) -> None:
        nonlocal checked
        output = driver.step(budget, only)
        checked += _check_step(driver, output, captured, reference, TOLERANCE)

    for req_id in ("r0", "r1", "r2"):
        driver.add(req_id, prompts[req_id], GREEDY)
    step()  # r0, r1 whole; r2's first 12 tokens
    driver.add("r3", prompts["r3"], GREEDY)
    step(48)  # 2 decodes beside r2's last chunk (a cached context) and r3 whole
    driver.add("r4", prompts["r4"], GREEDY)
    driver.add("r5", prompts["r5"], GREEDY)
    step()  # 4 decodes (the matmul path) beside two fresh prompts of one length
    driver.preempt("r1")  # recomputed from prompt + output
    for _ in range(3):
        step(48)
    step(only=["r2"])  # a lone decode
    for _ in range(4):
        step(48)
    return checked


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logits_equal_transformers_in_mixed_batches(models: dict[str, Path],
                                                    architecture: str) -> None:
    assert _short_mixed_run(models[architecture], _reference(models[architecture])) > 40


@pytest.mark.parametrize("architecture", ["MistralForCausalLM"])
def test_a_lone_decode_past_the_window_equals_transformers(models: dict[str, Path],
                                                          architecture: str) -> None:
    """One sequence decoding alone (read in place from its blocks, without a mask, in a
    full-attention model) sees only its window."""
    reference = _reference(models[architecture])
    worker, driver, captured = _worker(models[architecture])
    prompt = torch.randint(3, worker.vocab_size, (20,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    driver.add("a", prompt, GREEDY)
    checked = sum(_check_step(driver, driver.step(64), captured, reference, TOLERANCE)
                  for _ in range(10))
    assert checked == 10


def test_a_lone_decode_within_the_window_takes_the_one_call(models: dict[str, Path]) -> None:
    """Mistral has the one C call's shape: a sequence decoding alone takes it while its
    context fits in the window (8 tokens), then the torch forward's windowed attention;
    both equal transformers."""
    architecture = "MistralForCausalLM"
    reference = _reference(models[architecture])
    worker, driver, captured = _worker(models[architecture])
    runner = worker.model_runner
    assert runner is not None and runner.lone_decode is not None
    forwards: list[int] = []  # the steps that ran the torch forward
    runner.model.register_forward_pre_hook(  # type: ignore[attr-defined]
        lambda *_: forwards.append(1))
    driver.add("a", [5, 9, 14], GREEDY)
    checked = sum(_check_step(driver, driver.step(64), captured, reference, TOLERANCE)
                  for _ in range(10))
    assert checked == 10
    assert len(forwards) == 1 + 4  # the prompt, and contexts 9-12; contexts 4-8: the call


def test_every_decoder_architecture_is_the_one_decoder() -> None:
    """The registry maps each family's HF name to a class that only names it."""
    from gateway.models.archs.decoder import DecoderForCausalLM
    from gateway.models.info.decoder_config import DECODER_READERS
    from gateway.models.info.registry import ModelRegistry

    for architecture in DECODER_READERS:
        cls, _ = ModelRegistry.resolve_model_cls(architecture)
        assert cls.__name__ == architecture and cls.__bases__ == (DecoderForCausalLM,)
        assert {name for name in vars(cls) if not name.startswith("__")} == {"architecture"}


def test_phi3_on_two_ranks_generates_what_it_does_on_one(models: dict[str, Path]) -> None:
    """Each rank cuts its heads and its part of the MLP out of Phi-3's fused tensors."""
    from gateway.executor.mp import MultiprocExecutor
    from tests.executor.test_mp_executor import _config, _generate, _one_rank

    model = models["Phi3ForCausalLM"]
    expected = _generate(*_one_rank(_config(model, ranks=1)))
    executor = MultiprocExecutor(_config(model, ranks=2))
    try:
        assert _generate(executor, executor.num_kv_blocks) == expected
    finally:
        executor.shutdown()
    assert all(len(tokens) >= 12 for tokens in expected.values())


@pytest.mark.e2e
def test_a_gemma3_model_served_end_to_end_answers_as_transformers_generates(
        models: dict[str, Path], tmp_path: Path) -> None:
    """The real server on the tiny Gemma 3 (windows, norms, soft-capping): a greedy
    completion is transformers' greedy continuation of the same prompt tokens."""
    import httpx

    from tests.frontend.conftest import SERVED_NAME, tiny_server

    model = models["Gemma3ForCausalLM"]
    with tiny_server(model, log_path=tmp_path / "server.log") as server:
        answer = httpx.post(server.url("/v1/completions"), timeout=60, json={
            "model": SERVED_NAME, "prompt": "Once upon a time there was a server",
            "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    prompt = body["choices"][0]["prompt_token_ids"]
    with torch.no_grad():
        expected = _reference(model).generate(torch.tensor([prompt]), max_new_tokens=12,
                                              min_new_tokens=12, do_sample=False)
    assert body["choices"][0]["token_ids"] == expected[0, len(prompt):].tolist()
