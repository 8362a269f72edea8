"""The CUDA-graph runner's plain parts (worker/cuda_graphs.py): the buckets captured for a
cap and --max-num-seqs, the bucket a step replays (or none: eager), when a worker captures
at all, the padding of a decode step, and the static buffers' copy-in, replay and copy-out
through an eager stand-in graph of a toy forward (tests/models/triton/test_decode_graphs.py
runs the real model through the same path)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from gateway.config import CompilationConfig
from gateway.models.layers.attention import AttentionMetadata
from gateway.models.layers.triton_attention import build_triton_metadata
from gateway.worker.cuda_graphs import (
    EagerGraph,
    StaticInputs,
    bucket_for,
    capture_decode_graphs,
    capture_sizes,
    describe_sizes,
    graph_memory_estimate,
    graph_sizes,
    pad_decode_step,
)

VLLM_512 = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


@pytest.mark.parametrize(("max_num_seqs", "largest", "sizes", "expected"), [
    (1024, None, None, VLLM_512),  # vLLM's default list, capped at 512
    (512, None, None, VLLM_512),
    (64, None, None, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),  # --max-num-seqs caps
    (100, None, None, [1, 2, 4] + list(range(8, 97, 8)) + [100]),  # the cap itself too
    (300, None, None, [1, 2, 4] + list(range(8, 256, 8)) + [256, 272, 288, 300]),
    (256, 20, None, [1, 2, 4, 8, 16, 20]),  # --max-cudagraph-capture-size
    (3, None, None, [1, 2, 3]),
    (1, None, None, [1]),
    (64, None, [48, 1, 3, 3, 128], [1, 3, 48]),  # --cudagraph-capture-sizes, capped
    (512, 16, [8, 32], [8]),
])
def test_capture_sizes(max_num_seqs: int, largest: int | None, sizes: list[int] | None,
                       expected: list[int]) -> None:
    assert capture_sizes(max_num_seqs, largest, sizes) == expected


SIZES = [1, 2, 4, 8, 16]


@pytest.mark.parametrize(("query_lens", "bucket"), [
    ([1], 1), ([1, 1], 2), ([1] * 3, 4), ([1] * 5, 8), ([1] * 16, 16),
    ([1] * 17, None),  # above the largest: eager
    ([1, 1, 7], None), ([4], None), ([1, 2], None),  # a prefill chunk: eager
    ([], None),
])
def test_the_bucket_of_a_step(query_lens: list[int], bucket: int | None) -> None:
    assert bucket_for(np.array(query_lens, dtype=np.int64), SIZES) == bucket
    assert bucket_for(np.array(query_lens, dtype=np.int64), []) is None  # no graphs


def test_when_a_worker_captures() -> None:
    on = CompilationConfig()
    assert graph_sizes(on, 8, "cuda", True, 1) == ([1, 2, 4, 8], "")
    assert graph_sizes(CompilationConfig(max_cudagraph_capture_size=2), 8, "cuda", True,
                       1) == ([1, 2], "")
    assert graph_sizes(CompilationConfig(enforce_eager=True), 8, "cuda", True, 1) == \
        ([], "--enforce-eager")
    sizes, why_not = graph_sizes(CompilationConfig(cudagraph_capture_sizes=[16]), 8, "cuda",
                                 True, 1)
    assert sizes == [] and "--cudagraph-capture-sizes" in why_not
    for device, triton, tp in (("cpu", True, 1), ("cuda", False, 1), ("cuda", True, 2)):
        sizes, why_not = graph_sizes(on, 8, device, triton, tp)
        assert sizes == [] and why_not


def test_a_decode_step_padded_to_its_bucket() -> None:
    table = np.array([[3, 7, 0, 0], [5, 0, 0, 0], [9, 2, 4, 0]])
    step = pad_decode_step(np.array([11, 12, 13]), np.array([20, 3, 40]), table,
                           block_size=16, batch_size=8)
    assert step.num_real == 3
    assert step.input_ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert step.positions.tolist() == [20, 3, 40, 0, 0, 0, 0, 0]
    meta = step.meta
    # Each real token at its slot (block of position // 16, offset position % 16); padded
    # tokens at -1, which the KV store skips.
    assert meta.slot_mapping.tolist() == [7 * 16 + 4, 5 * 16 + 3, 4 * 16 + 8] + [-1] * 5
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]  # no queries
    assert meta.seq_lens.tolist() == [21, 4, 41, 0, 0, 0, 0, 0]  # 0: attends to nothing
    assert meta.block_table.shape == (8, 3)  # the columns of the longest (41 tokens)
    assert meta.block_table[:3].tolist() == table[:, :3].tolist()
    assert not meta.block_table[3:].any()
    assert meta.num_decode_seqs == 8 and meta.max_query_len == 1


def _toy_forward(calls: list[int]):  # type: ignore[no-untyped-def]
    """A forward that reads every static buffer: a row's token, position, slot and seq_len."""
    def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        calls.append(len(input_ids))
        triton = meta.triton
        assert triton is not None and triton.num_decode_seqs == len(input_ids)
        return torch.stack((input_ids, positions, triton.slot_mapping,
                            triton.seq_lens.long(), triton.block_table[:, 0].long()), 1)
    return forward


def test_replay_reads_the_step_copied_into_the_static_buffers() -> None:
    calls: list[int] = []
    static = StaticInputs(8, 4, 16, 256, torch.device("cpu"))
    graphs, failed = capture_decode_graphs(_toy_forward(calls), [2, 8], static, EagerGraph)
    assert failed == [] and calls == [8, 8, 2, 2]  # largest first: warm-up, capture
    table = np.array([[3, 7, 0, 0], [5, 0, 0, 0], [9, 2, 4, 0]])
    for rows in (3, 2):  # the second step, in a smaller bucket, after the first
        step = pad_decode_step(np.arange(11, 11 + rows), np.array([20, 3, 40])[:rows],
                               table[:rows], 16, graphs.bucket_for(np.ones(rows)) or 0)
        out = graphs.run(step)
        assert out.tolist() == [[11, 20, 7 * 16 + 4, 21, 3], [12, 3, 5 * 16 + 3, 4, 5],
                                [13, 40, 4 * 16 + 8, 41, 9]][:rows]
        graph = graphs.graphs[len(step.input_ids)]
        assert not graph.output[rows:, 2:4].ne(torch.tensor([-1, 0])).any()  # padding
    assert graphs.bucket_for(np.ones(9)) is None


def test_a_failed_capture_warns_once_naming_its_bucket_and_runs_eagerly(
        caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []
    toy = _toy_forward(calls)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if len(input_ids) == 4:
            raise RuntimeError("operation not permitted when stream is capturing")
        return toy(input_ids, positions, meta)

    static = StaticInputs(8, 4, 16, 256, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="gateway.worker.cuda_graphs"):
        graphs, failed = capture_decode_graphs(forward, [1, 2, 4, 8], static, EagerGraph)
    assert failed == [4] and sorted(graphs.graphs) == [1, 2, 8]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "batch size 4 " in record.getMessage() and "eagerly" in record.getMessage()
    assert graphs.bucket_for(np.ones(3)) is None  # its bucket's steps: eager
    assert graphs.bucket_for(np.ones(5)) == 8


def test_describe_sizes() -> None:
    assert describe_sizes([1, 2, 4]) == "1, 2, 4"
    assert describe_sizes(VLLM_512) == "1, 2, 4, ..., 512"


def test_the_graphs_memory_is_the_largest_capture_and_the_others_outputs() -> None:
    # 1, 2, 4, 8 share the pool of 8's capture; each smaller graph keeps its output rows.
    assert graph_memory_estimate(10_000, [1, 2, 4, 8], 128) == 10_000 + 7 * 128
    assert graph_memory_estimate(10_000, [8], 128) == 10_000


@pytest.mark.parametrize(("num_seqs", "batch_size", "seed"),
                         [(1, 1, 0), (3, 4, 1), (5, 8, 2), (8, 8, 3), (30, 32, 4)])
def test_the_padded_step_is_the_general_metadatas_padding(num_seqs: int, batch_size: int,
                                                          seed: int) -> None:
    """pad_decode_step writes build_triton_metadata's result out for decodes alone."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 1000, (num_seqs, 12))
    positions = rng.integers(0, 12 * 16, num_seqs)
    step = pad_decode_step(rng.integers(0, 100, num_seqs), positions, table, 16, batch_size)
    want = build_triton_metadata(np.ones(num_seqs, dtype=np.int64), positions, table, 16,
                                 num_seqs_padded=batch_size, num_tokens_padded=batch_size)
    got = step.meta
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_table"):
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.num_decode_seqs, got.max_query_len, got.max_seq_len, got.block_size) == \
        (want.num_decode_seqs, want.max_query_len, want.max_seq_len, want.block_size)
