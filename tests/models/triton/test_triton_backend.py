"""The Triton attention backend, forced on the CPU (Triton's interpreter), serves the tiny
models as the torch path does: the same greedy tokens and logits at every step of a mixed
batch (fresh prompts, chunked prefill, decodes across block boundaries, a preempted
request recomputed), for Llama and for Mistral's sliding window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.models.layers import triton_attention
from tests.models.test_llama import GREEDY, _worker
from tests.tiny_model import build_tiny_decoder, build_tiny_llama

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the torch path's kernels

TOLERANCE = 1e-4  # float32, as the torch path against transformers


def _run(model: Path, backend: str, monkeypatch: pytest.MonkeyPatch,
         ) -> list[tuple[list[str], list[int], torch.Tensor]]:
    """Each step's sampled requests, tokens and logits, on one attention backend."""
    monkeypatch.setenv("GATEWAY_ATTENTION_BACKEND", backend)
    worker, driver, captured = _worker(model)
    assert worker.model_runner.triton_attention == (backend == "triton")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, worker.vocab_size, (n,), generator=generator).tolist()
               for n in (1, 15, 31, 5)]
    steps = []

    def step(budget: int = 48) -> None:
        output = driver.step(budget)
        steps.append((output.req_ids, output.sampled_token_ids, captured[-1]))

    for i in range(3):
        driver.add(f"r{i}", prompts[i], GREEDY)
    step(40)  # r0, r1 whole; r2's first 24 tokens
    step()  # 2 decodes beside r2's last chunk, over its 24 cached tokens
    driver.add("r3", prompts[3], GREEDY)
    step()  # 3 decodes (r1 crosses into its second block) beside a fresh prompt
    driver.preempt("r1")  # recomputed from prompt + output, as a fresh prompt
    for _ in range(3):
        step()  # r2 crosses into its third block
    return steps


def _assert_same_steps(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _run(model, "torch", monkeypatch)
    got = _run(model, "triton", monkeypatch)
    assert len(got) == len(expected) == 6
    for (req_ids, tokens, logits), (want_ids, want_tokens, want_logits) in zip(got, expected):
        assert (req_ids, tokens) == (want_ids, want_tokens)
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=TOLERANCE)
    assert not any(kernel.failed for kernel in triton_attention._kernels())


def test_llama_on_triton_equals_the_torch_path(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_same_steps(build_tiny_llama(tmp_path / "tiny"), monkeypatch)


def test_sliding_window_on_triton_equals_the_torch_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mistral's window of 8 keys, shorter than every prompt but the first."""
    model = build_tiny_decoder(tmp_path / "mistral", "MistralForCausalLM")
    _assert_same_steps(model, monkeypatch)
