"""CUDA graphs of decode steps (worker process): the model's forward of a pure-decode step,
captured at start-up once per batch-size bucket and replayed instead of launching its
kernels one by one.

The bucket list, the choice of bucket for a step and the padding of a step to it are plain
functions; `DecodeGraphs` holds the static input buffers every graph reads (views of one
set, as vLLM does), copies a padded step into them, replays and returns the real rows'
hidden states. Sampling stays outside the graphs. `EagerGraph` replays by calling the
forward on the same buffers: the CPU tests run every step of this path with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from gateway.config import CompilationConfig
from gateway.logger import init_logger
from gateway.models.layers.attention import AttentionMetadata
from gateway.models.layers.triton_attention import (
    TritonAttentionMetadata,
    build_triton_metadata,
)

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from gateway.worker.model_runner import ModelRunner

logger = init_logger(__name__)

#: vLLM's default largest capture size (--max-cudagraph-capture-size).
DEFAULT_MAX_CAPTURE_SIZE = 512
_GIB = 1024**3
_NO_ROWS = torch.empty(0, dtype=torch.int64)  # write_index: the Triton store writes


def capture_sizes(max_num_seqs: int, max_capture_size: int | None = None,
                  sizes: Sequence[int] | None = None) -> list[int]:
    """The batch sizes to capture, ascending. vLLM's default pattern: 1, 2, 4, every 8
    below 256, every 16 from 256, up to the cap = min(max_num_seqs, max_capture_size
    (default 512)), and the cap itself, so that every decode batch a step may hold has a
    bucket. `sizes` given (--cudagraph-capture-sizes): those, up to the same cap."""
    cap = min(max_num_seqs, DEFAULT_MAX_CAPTURE_SIZE if max_capture_size is None
              else max_capture_size)
    if sizes is not None:
        return sorted({size for size in sizes if size <= cap})
    pattern = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, cap + 1, 16))
    chosen = [size for size in pattern if size <= cap]
    return chosen if chosen[-1] == cap else chosen + [cap]


def graph_sizes(config: CompilationConfig, max_num_seqs: int, device_type: str,
                triton_attention: bool, tensor_parallel_size: int) -> tuple[list[int], str]:
    """The batch sizes a worker captures, or none and why (for its start-up line)."""
    if config.enforce_eager:
        return [], "--enforce-eager"
    if device_type != "cuda":
        return [], f"not on a CUDA device ({device_type})"
    if not triton_attention:
        return [], "attention does not run on the Triton kernels (GATEWAY_ATTENTION_BACKEND)"
    if tensor_parallel_size > 1:
        return [], "not yet with tensor parallelism"
    sizes = capture_sizes(max_num_seqs, config.max_cudagraph_capture_size,
                          config.cudagraph_capture_sizes)
    return sizes, "" if sizes else (
        "every --cudagraph-capture-sizes is above --max-num-seqs or "
        "--max-cudagraph-capture-size")


def bucket_for(query_lens: np.ndarray, sizes: Sequence[int]) -> int | None:
    """The captured batch size a step of `query_lens` [B] (tokens per request) replays: the
    smallest size >= B when the step is pure decode (one token per request); None (run it
    eagerly) for a step with a prefill chunk, a batch above the largest size, or no
    sizes at all (--enforce-eager, no CUDA)."""
    num_seqs = len(query_lens)
    if not sizes or not num_seqs or num_seqs > sizes[-1] or bool((query_lens != 1).any()):
        return None
    return sizes[int(np.searchsorted(np.asarray(sizes), num_seqs))]


@dataclass
class PaddedDecode:
    """A pure-decode step padded to a bucket, as host tensors: B real rows, then padding
    (token 0 at position 0, slot -1, seq_len 0: it reads and writes no KV block)."""

    input_ids: torch.Tensor  # [B'] int64
    positions: torch.Tensor  # [B'] int64
    meta: TritonAttentionMetadata  # padded to B' sequences and tokens
    num_real: int


def pad_decode_step(token_ids: np.ndarray, positions: np.ndarray, block_table: np.ndarray,
                    block_size: int, batch_size: int) -> PaddedDecode:
    """The decode step of B requests, each with its one token `token_ids` [B] at
    `positions` [B] (= its cached tokens) and its blocks `block_table` [B, >= W], padded to
    `batch_size` rows. Its block table has the W columns the longest sequence uses: the
    kernel reads no further, so the static table's later columns may hold anything."""
    # build_triton_metadata's padded result, written out for one query a sequence (a
    # step's host work: about a quarter of the general function's time).
    num_real = len(token_ids)
    positions = np.asarray(positions, dtype=np.int64)
    ids = np.zeros(batch_size, dtype=np.int64)
    ids[:num_real] = token_ids
    padded_positions = np.zeros(batch_size, dtype=np.int64)
    padded_positions[:num_real] = positions
    slots = np.full(batch_size, -1, dtype=np.int64)
    slots[:num_real] = (block_table[np.arange(num_real), positions // block_size]
                        * block_size + positions % block_size)
    query_start_loc = np.minimum(np.arange(batch_size + 1, dtype=np.int32), num_real)
    seq_lens = np.zeros(batch_size, dtype=np.int32)
    seq_lens[:num_real] = positions + 1
    max_seq_len = int(positions.max(initial=-1)) + 1
    columns = max(1, -(-max_seq_len // block_size))
    table = np.zeros((batch_size, columns), dtype=np.int32)
    table[:num_real] = block_table[:, :columns]
    meta = TritonAttentionMetadata(
        slot_mapping=torch.from_numpy(slots), query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.from_numpy(seq_lens), block_table=torch.from_numpy(table),
        block_size=block_size, num_decode_seqs=batch_size, max_query_len=1 if num_real else 0,
        max_seq_len=max_seq_len)
    return PaddedDecode(torch.from_numpy(ids), torch.from_numpy(padded_positions), meta,
                        num_real)


class StaticInputs:
    """The buffers every graph reads, sized for the largest bucket; a graph of batch B
    reads the first B rows (and B + 1 query starts)."""

    def __init__(self, max_batch: int, num_block_columns: int, block_size: int,
                 max_model_len: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_batch, dtype=torch.int64)
        self.positions = zeros(max_batch, dtype=torch.int64)
        self.slot_mapping = zeros(max_batch, dtype=torch.int64).fill_(-1)
        self.query_start_loc = zeros(max_batch + 1)
        self.seq_lens = zeros(max_batch)  # 0: every row padded until a step loads
        self.block_table = zeros(max_batch, num_block_columns)
        self.block_size, self.max_model_len = block_size, max_model_len

    def meta(self, batch_size: int) -> AttentionMetadata:
        """The metadata of a graph of `batch_size` rows: views of the buffers, every row a
        decode (padded rows included: they have no query), and the longest context the
        server allows as the launch hint (so the split of long decodes holds for any)."""
        return AttentionMetadata(write_index=_NO_ROWS, block_size=self.block_size,
                                 triton=TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[:batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_table=self.block_table[:batch_size],
            block_size=self.block_size, num_decode_seqs=batch_size, max_query_len=1,
            max_seq_len=self.max_model_len))

    def load(self, step: PaddedDecode) -> None:
        """Copy a padded step into the first rows of the buffers (without waiting); of the
        block table, only the columns the step uses (a long --max-model-len makes the
        whole table megabytes a step)."""
        size, meta = len(step.input_ids), step.meta
        columns = meta.block_table.shape[1]
        for target, source in ((self.input_ids[:size], step.input_ids),
                               (self.positions[:size], step.positions),
                               (self.slot_mapping[:size], meta.slot_mapping),
                               (self.query_start_loc[:size + 1], meta.query_start_loc),
                               (self.seq_lens[:size], meta.seq_lens),
                               (self.block_table[:size, :columns], meta.block_table)):
            target.copy_(source, non_blocking=True)


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def model_forward(model: Callable[..., torch.Tensor], kv_caches: list[torch.Tensor]) -> Forward:
    """The forward the graphs record: the model over the runner's KV cache."""
    def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return model(input_ids, positions, kv_caches, meta)

    return forward


class Graph(Protocol):
    """One bucket's recorded forward: `replay()` recomputes `output` from the buffers."""

    output: torch.Tensor

    def replay(self) -> None: ...


class EagerGraph:
    """A graph that replays by running the forward on the static buffers into its output
    buffer: the CPU's stand-in, so that the copy-in, replay and copy-out are tested."""

    def __init__(self, run: Callable[[], torch.Tensor]) -> None:
        self.run = run
        self.output = run().clone()

    def replay(self) -> None:
        self.output.copy_(self.run())


class CudaGraph:
    """A CUDA graph of the forward, recorded into the pool all graphs share."""

    def __init__(self, run: Callable[[], torch.Tensor], pool: _POOL_HANDLE | None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of the process (the engine core's, under the uni
        # executor) touching CUDA meanwhile neither breaks the capture nor fails itself.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.output = run()

    def replay(self) -> None:
        self.graph.replay()


GraphFactory = Callable[[Callable[[], torch.Tensor]], Graph]


class DecodeGraphs:
    """The captured graphs of one model runner, by batch size."""

    def __init__(self, sizes: list[int], static: StaticInputs, graphs: dict[int, Graph],
                 ) -> None:
        self.sizes, self.static, self.graphs = sizes, static, graphs

    def bucket_for(self, query_lens: np.ndarray) -> int | None:
        """The bucket a step replays (None: it runs eagerly, as does a step whose bucket
        failed to capture)."""
        size = bucket_for(query_lens, self.sizes)
        return size if size in self.graphs else None

    def run(self, step: PaddedDecode) -> torch.Tensor:
        """The hidden states [B, E] of the real rows of a padded step, by replay."""
        self.static.load(step)
        graph = self.graphs[len(step.input_ids)]
        graph.replay()
        return graph.output[:step.num_real]


@dataclass
class CaptureReport:
    captured: list[int]
    failed: list[int]
    seconds: float
    graph_bytes: int


def capture_decode_graphs(forward: Forward, sizes: list[int], static: StaticInputs,
                          make_graph: GraphFactory, warn: bool = True,
                          ) -> tuple[DecodeGraphs, list[int]]:
    """Each size's graph, largest first (so smaller ones reuse its pool's memory), after an
    eager warm-up run of the same shape (Triton compiles there, never during capture). A
    size whose capture fails is left out with one WARNING naming it (unless not `warn`):
    its steps run eagerly. Returns the graphs and the failed sizes."""
    graphs: dict[int, Graph] = {}
    failed = []
    for size in sorted(sizes, reverse=True):
        meta = static.meta(size)

        def run(size: int = size, meta: AttentionMetadata = meta) -> torch.Tensor:
            return forward(static.input_ids[:size], static.positions[:size], meta)

        try:
            run()  # warm-up: every row is padding, nothing is read or written
            graphs[size] = make_graph(run)
        except Exception as error:  # noqa: BLE001 - any failure: that bucket runs eagerly
            failed.append(size)
            if not warn:
                continue
            logger.warning("CUDA graph of decode batch size %d could not be captured (%s: "
                           "%s); steps of that bucket run eagerly", size, type(error).__name__,
                           str(error).splitlines()[0][:200] if str(error) else "")
    return DecodeGraphs(sizes, static, graphs), failed


def capture_on_cuda(forward: Forward, sizes: list[int], static: StaticInputs,
                    device: torch.device) -> tuple[DecodeGraphs, CaptureReport]:
    """capture_decode_graphs with CUDA graphs in one shared pool, timed and measured (the
    device memory the graphs took, from the driver's free memory)."""
    started = time.perf_counter()
    free_before = _free_bytes(device)
    pool = torch.cuda.graph_pool_handle()
    graphs, failed = capture_decode_graphs(forward, sizes, static,
                                           lambda run: CudaGraph(run, pool))
    return graphs, CaptureReport(captured=sorted(graphs.graphs), failed=failed,
                                 seconds=time.perf_counter() - started,
                                 graph_bytes=max(free_before - _free_bytes(device), 0))


def capture_eager(forward: Forward, sizes: list[int], static: StaticInputs,
                  device: torch.device) -> tuple[DecodeGraphs, CaptureReport]:
    """capture_on_cuda's stand-in off CUDA (tests): EagerGraphs, no device memory."""
    started = time.perf_counter()
    graphs, failed = capture_decode_graphs(forward, sizes, static, EagerGraph)
    return graphs, CaptureReport(captured=sorted(graphs.graphs), failed=failed,
                                 seconds=time.perf_counter() - started, graph_bytes=0)


Capture = Callable[[Forward, list[int], StaticInputs, torch.device],
                   tuple[DecodeGraphs, CaptureReport]]


def start_graphs(runner: ModelRunner, sizes: list[int], max_prompt_tokens: int,
                 capture: Capture = capture_on_cuda) -> None:
    """What a CUDA worker runs once its KV cache is allocated: warm the prompt kernels up
    (warm_up_prefill), capture the graphs of `sizes` for `runner` and log vLLM's line with
    the time and memory they took."""
    model, device = runner.model, runner.device
    forward = model_forward(model, runner.kv_caches)
    columns = runner.batch.block_table.shape[1]
    started = time.perf_counter()
    num_prompts = warm_up_prefill(forward, model.compute_logits, max_prompt_tokens,
                                  runner.block_size, columns, device)
    warm_up_s = time.perf_counter() - started
    static = StaticInputs(sizes[-1], columns, runner.block_size, runner.max_model_len, device)
    runner.decode_graphs, report = capture(forward, sizes, static, device)
    logger.info("Graph capturing finished in %.1f secs, took %.2f GiB: %d decode batch sizes "
                "(%s%s), kernels warmed up for %d prompt lengths in %.1f s", report.seconds,
                report.graph_bytes / _GIB, len(report.captured),
                describe_sizes(report.captured),
                f"; {len(report.failed)} failed, run eagerly" if report.failed else "",
                num_prompts, warm_up_s)


def _free_bytes(device: torch.device) -> int:
    """The device's free memory once torch's allocator returned what no tensor holds
    (the warm-up runs' activations, not the graphs' pool)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info(device)[0])


def graph_memory_estimate(largest_graph_bytes: int, sizes: list[int],
                          bytes_per_output_row: int) -> int:
    """The device memory all graphs of `sizes` take in their shared pool, from what one
    capture of the largest took: each capture's intermediate tensors are freed when it
    ends, so the smaller ones reuse them, and only their outputs [B, E] stay."""
    return largest_graph_bytes + sum(sizes[:-1]) * bytes_per_output_row


def estimate_on_cuda(forward: Forward, sizes: list[int], static: StaticInputs,
                     device: torch.device) -> int:
    """graph_memory_estimate from one capture of the largest size (then dropped): what the
    KV-cache sizing sets aside for the graphs (gpu_memory.py). 0 where it cannot capture
    (the real capture then warns)."""
    free_before = _free_bytes(device)
    graphs, _ = capture_decode_graphs(forward, sizes[-1:], static,
                                      lambda run: CudaGraph(run, None), warn=False)
    taken = max(free_before - _free_bytes(device), 0)
    graph = graphs.graphs.pop(sizes[-1], None)
    if graph is None:
        return 0
    row_bytes = graph.output[0].numel() * graph.output.element_size()
    del graph
    torch.cuda.empty_cache()
    return graph_memory_estimate(taken, sizes, row_bytes)


def warm_up_prefill(forward: Forward, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    max_tokens: int, block_size: int, num_block_columns: int,
                    device: torch.device) -> int:
    """Eager prompt steps of 1, 2, 4, ... tokens (up to 256 and `max_tokens`), each one
    sequence writing nothing (slot -1), through the model and its logits: the Triton
    kernels' prefill shapes compile here, not on the first requests. Returns the steps."""
    lengths = [1 << k for k in range(9) if 1 << k <= min(max_tokens, 256)]
    table = np.zeros((1, num_block_columns), dtype=np.int32)
    for length in lengths:
        meta = build_triton_metadata(np.array([length]), np.array([0]), table, block_size)
        meta.slot_mapping.fill_(-1)
        ids = torch.zeros(length, dtype=torch.int64, device=device)
        hidden = forward(ids, torch.arange(length, device=device), AttentionMetadata(
            write_index=_NO_ROWS, block_size=block_size, triton=meta.to(device)))
        compute_logits(hidden[-1:])
    return len(lengths)


def describe_sizes(sizes: list[int]) -> str:
    """'1, 2, 4, ..., 512' for the start-up line."""
    if len(sizes) <= 5:
        return ", ".join(map(str, sizes)) or "none"
    return f"{sizes[0]}, {sizes[1]}, {sizes[2]}, ..., {sizes[-1]}"
