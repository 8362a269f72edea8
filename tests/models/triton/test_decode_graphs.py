"""The CUDA-graph path of decode steps (worker/cuda_graphs.py) on the CPU: the graphs are
`EagerGraph`s, which replay by running the tiny model (Triton's interpreter for attention)
on the same static buffers a CUDA graph reads, so the padding, copy-in, replay and
copy-out are what a GPU runs. A padded step gives the real rows the unpadded step's hidden
states and writes the KV cache at the real rows' slots only; served through a worker,
decode steps replay and every step's tokens and logits equal those without graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gateway.models.layers.attention import AttentionMetadata
from gateway.models.layers.triton_attention import build_triton_metadata
from gateway.worker import cuda_graphs
from gateway.worker.cuda_graphs import (
    EagerGraph,
    StaticInputs,
    capture_decode_graphs,
    model_forward,
    pad_decode_step,
)
from tests.models.test_llama import GREEDY, _worker
from tests.tiny_model import build_tiny_decoder

TOLERANCE = 1e-5  # float32: the same kernels, products of other row counts


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3's tiny decoder: sliding layers (window 8, shorter than the contexts),
    soft-capped logits and q/k norms, besides what every family has."""
    return build_tiny_decoder(tmp_path_factory.mktemp("graphs") / "gemma", "Gemma3ForCausalLM")


def _triton_worker(model: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("GATEWAY_ATTENTION_BACKEND", "triton")
    worker, driver, captured = _worker(model)
    runner = worker.model_runner
    assert runner.triton_attention
    return worker, runner, driver, captured


def _capture(runner, sizes: list[int]):  # type: ignore[no-untyped-def]
    static = StaticInputs(sizes[-1], runner.batch.block_table.shape[1], runner.block_size,
                          runner.max_model_len, runner.device)
    with torch.inference_mode():
        return capture_decode_graphs(model_forward(runner.model, runner.kv_caches), sizes,
                                     static, EagerGraph)


def test_a_padded_step_equals_the_unpadded_one_and_writes_only_its_rows(
        gemma: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker, runner, _, _ = _triton_worker(gemma, monkeypatch)
    generator = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:  # noise: a slot read or written by mistake shows
        cache.copy_(torch.randn(cache.shape, generator=generator))
    noise = [cache.clone() for cache in runner.kv_caches]
    graphs, failed = _capture(runner, [8])
    assert failed == [] and list(graphs.graphs) == [8]
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_caches, noise))  # capture: none

    block_size = runner.block_size
    columns = runner.batch.block_table.shape[1]
    rng = np.random.default_rng(0)
    blocks = rng.permutation(runner.num_blocks)
    # The second step's padding covers the first's stale rows, and its shorter contexts
    # leave the first's block columns 1 to 3 in the static table (unread).
    for num_seqs, shortest, longest in ((7, 40, 64), (3, 1, 16)):
        context = rng.integers(shortest, longest, num_seqs)
        table = np.zeros((num_seqs, columns), dtype=np.int64)
        table[:, :4] = blocks[:num_seqs * 4].reshape(num_seqs, 4)
        blocks = blocks[num_seqs * 4:]
        token_ids = rng.integers(3, worker.vocab_size, num_seqs)
        for cache, before in zip(runner.kv_caches, noise):
            cache.copy_(before)
        with torch.inference_mode():
            step = pad_decode_step(token_ids, context, table, block_size, 8)
            got = graphs.run(step).clone()
            graph_caches = [cache.clone() for cache in runner.kv_caches]
            for cache, before in zip(runner.kv_caches, noise):
                cache.copy_(before)
            meta = build_triton_metadata(np.ones(num_seqs), context, table, block_size)
            want = runner.model(torch.from_numpy(token_ids), torch.from_numpy(context),
                                runner.kv_caches, AttentionMetadata(
                                    write_index=torch.empty(0, dtype=torch.int64),
                                    block_size=block_size, triton=meta))
        assert got.shape == want.shape == (num_seqs, want.shape[1])
        torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)
        slots = table[np.arange(num_seqs), context // block_size] * block_size \
            + context % block_size
        written = torch.zeros(noise[0].shape[2], dtype=torch.bool)
        written[torch.from_numpy(slots)] = True
        for graph_cache, eager_cache, before in zip(graph_caches, runner.kv_caches, noise):
            assert torch.equal(graph_cache[:, :, ~written], before[:, :, ~written])
            torch.testing.assert_close(graph_cache[:, :, written], eager_cache[:, :, written],
                                       rtol=0, atol=TOLERANCE)
            assert not torch.equal(graph_cache[:, :, written], before[:, :, written])


def _serve(model: Path, monkeypatch: pytest.MonkeyPatch, sizes: list[int] | None,
           ) -> tuple[list[tuple[list[str], list[int], torch.Tensor]], dict[int, int]]:
    """Each step's sampled requests, tokens and logits, and the replays by bucket."""
    worker, runner, driver, captured = _triton_worker(model, monkeypatch)
    replays: dict[int, int] = {}
    if sizes is not None:
        runner.decode_graphs, _ = _capture(runner, sizes)
        for size, graph in runner.decode_graphs.graphs.items():
            def counted(replay=graph.replay, size: int = size) -> None:  # type: ignore[no-untyped-def]
                replays[size] = replays.get(size, 0) + 1
                replay()
            graph.replay = counted  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, worker.vocab_size, (n,), generator=generator).tolist()
               for n in (5, 15, 20, 9, 3)]
    steps = []

    def step(budget: int = 64) -> None:
        output = driver.step(budget)
        steps.append((output.req_ids, output.sampled_token_ids, captured[-1]))

    for i in range(3):
        driver.add(f"r{i}", prompts[i], GREEDY)
    step()  # three prompts: eager
    step()  # three decodes: bucket 4 (r1 crosses into its second block)
    driver.finish("r0")
    step()  # two decodes: bucket 2
    driver.add("r3", prompts[3], GREEDY)
    step()  # two decodes beside a prompt: eager
    driver.add("r4", prompts[4], GREEDY)
    driver.add("r5", prompts[0], GREEDY)
    step()  # prompts: eager
    step()  # five decodes: above the largest bucket, eager
    driver.finish("r1")
    driver.finish("r2")
    step()  # three decodes: bucket 4 again, a row fewer than its padding
    return steps, replays


def test_decode_steps_replay_and_equal_eager_steps(
        gemma: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphs' static metadata carries each layer's window (the sliding layers see 8
    keys of contexts up to 24)."""
    expected, _ = _serve(gemma, monkeypatch, None)
    got, replays = _serve(gemma, monkeypatch, [1, 2, 4])
    assert replays == {4: 2, 2: 1}
    assert len(got) == len(expected) == 7
    for (req_ids, tokens, logits), (want_ids, want_tokens, want_logits) in zip(got, expected):
        assert (req_ids, tokens) == (want_ids, want_tokens)
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-4)


def test_start_up_warms_up_captures_and_logs_writing_nothing(
        gemma: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        ) -> None:
    """What a CUDA worker runs after allocating its KV cache (the CPU's graphs eager):
    prompt warm-ups of 1, 2, 4 and 8 tokens, the capture of each bucket, one INFO line;
    none of it writes the KV cache."""
    _, runner, _, _ = _triton_worker(gemma, monkeypatch)
    for cache in runner.kv_caches:
        cache.fill_(0.5)
    with caplog.at_level("INFO", logger="gateway.worker.cuda_graphs"), torch.inference_mode():
        cuda_graphs.start_graphs(runner, [1, 2], 8, cuda_graphs.capture_eager)
    assert runner.decode_graphs is not None and sorted(runner.decode_graphs.graphs) == [1, 2]
    (line,) = [r.getMessage() for r in caplog.records if "Graph capturing" in r.getMessage()]
    assert line.startswith("Graph capturing finished in ")
    assert "took 0.00 GiB: 2 decode batch sizes (1, 2), kernels warmed up for 4 prompt " \
        "lengths" in line
    assert all(bool((cache == 0.5).all()) for cache in runner.kv_caches)
