"""The model runner (worker process): one SchedulerOutput in, one ModelRunnerOutput out.

Each step: update the persistent batch, lay out the scheduled tokens flat (single-token
queries first, then prefill chunks, fresh prompts of equal length side by side), run the
model once, compute logits only for the requests that reach the end of their known tokens
this step, sample them, and append each sampled token to the request's output list. On the
CPU, a step of one token runs on one thread where the weights are kept quantized or the
step is one C call (models/kernels/cpu/lone_decode.py, which splits its own products
between the worker's threads): its many small ops cost more in waking and joining a second
thread than the thread saves (docs/cpu-performance.md). Float32 torch ops keep every thread.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch
from torch import nn

from gateway import envs
from gateway.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from gateway.models.kernels.cpu.lone_decode import LoneDecode
from gateway.models.layers.attention import AttentionMetadata, on_one_thread
from gateway.models.layers.quant_linear import QuantLinear
from gateway.models.layers.triton_attention import build_triton_metadata, use_triton_attention
from gateway.worker import logprobs
from gateway.worker.attention_inputs import AttentionInputs
from gateway.worker.cuda_graphs import DecodeGraphs, PaddedDecode, pad_decode_step
from gateway.worker.grammar_bitmask import apply_grammar_bitmask
from gateway.worker.host_buffers import to_device
from gateway.worker.input_batch import CachedRequestState, InputBatch
from gateway.worker.lora_manager import LoRAManager
from gateway.worker.rejection_sampler import DraftLayout, ranks
from gateway.worker.sampler import Sampler, StepSample

if TYPE_CHECKING:
    from gateway.worker.draft_proposer import DraftProposer

#: With GATEWAY_CPU_VERIFY_ONE_THREAD=1, a step verifying drafts of at most this many tokens
#: runs on one thread as a lone token does (the module docstring; default: every thread).
MAX_ONE_THREAD_VERIFY_TOKENS = 16
_NO_ROWS = torch.empty(0, dtype=torch.int64)  # write_index where the Triton store writes


class GenerativeModel(Protocol):
    """What the runner needs of a model class (ours, or one a plugin registers)."""

    #: (layers, kv heads, head dim): what one token's KV cache holds.
    kv_cache_spec: tuple[int, int, int]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [N] -> hidden states [N, E]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, E] -> logits [R, vocab]."""
        ...


@dataclass
class _Scheduled:
    state: CachedRequestState
    row: int
    start: int  # first position computed this step (= num_computed_tokens)
    num_tokens: int  # drafts included
    drafts: list[int] = field(default_factory=list)  # draft tokens after its known ones


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [R + V] int64: the positions whose logits are needed
    sampled: list[_Scheduled]  # the R requests that sample their last token, in order
    scheduled: list[_Scheduled]  # every request of the step, in flat token order
    #: Requests verifying drafts: their k + 1 positions follow the R in logits_indices.
    verified: list[_Scheduled] = field(default_factory=list)
    graph_step: PaddedDecode | None = None  # set: the step replays a CUDA graph instead
    #: Requests whose LoRA adapter could not be read: req_id -> why (they fail this step).
    lora_errors: dict[str, str] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: nn.Module, sampler: Sampler, device: torch.device,
                 dtype: torch.dtype, block_size: int, max_model_len: int,
                 batch: InputBatch | None = None) -> None:
        """`batch`: another runner's persistent batch to read (a draft model's runner reads
        the target's); None: its own."""
        self.model: GenerativeModel = cast(GenerativeModel, model)
        self.sampler = sampler
        self.device, self.dtype = device, dtype
        self.block_size, self.max_model_len = block_size, max_model_len
        self.batch = batch or InputBatch(max_blocks_per_request=-(-max_model_len // block_size))
        fit_context = getattr(model, "fit_context", None)
        if callable(fit_context):  # rope tables of the served length
            fit_context(max_model_len)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.prompt_logprobs = logprobs.PromptLogprobs()
        self.attention = AttentionInputs(self.batch, block_size, device, dtype)
        self.lone_decode = LoneDecode.build(model, device, dtype)
        # The Triton attention backend (CUDA, or forced): its own metadata, built below.
        self.triton_attention = use_triton_attention(device)
        #: LoRA adapters (--enable-lora): set by the worker after the lone decode is built
        #: on the bare projections, which then serves only the steps that run no adapter.
        self.lora: LoRAManager | None = None
        self._lone_token_one_thread = device.type == "cpu" and (
            self.lone_decode is not None
            or any(isinstance(module, QuantLinear) for module in model.modules()))
        self._verify_one_thread = envs.cpu_verify_one_thread()
        # CUDA graphs of decode steps (cuda_graphs.py), captured by the worker at start-up.
        self.decode_graphs: DecodeGraphs | None = None
        #: A draft model's proposer (--speculative-config with a model), set by the worker.
        self.drafter: DraftProposer | None = None

    # ------------------------------------------------------------------ KV cache
    def kv_cache_bytes_per_block(self) -> int:
        num_layers, num_kv_heads, head_dim = self.model.kv_cache_spec
        element_size = torch.empty((), dtype=self.dtype).element_size()
        draft = 0 if self.drafter is None else self.drafter.kv_cache_bytes_per_block()
        return 2 * num_layers * num_kv_heads * head_dim * self.block_size * element_size + draft

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the whole cache once: per layer [2, KV, num_blocks * block_size, D]."""
        num_layers, num_kv_heads, head_dim = self.model.kv_cache_spec
        # Zeroed, not empty: padded slots are masked, and 0 * garbage could be NaN.
        cache = torch.zeros(num_layers, 2, num_kv_heads, num_blocks * self.block_size,
                            head_dim, dtype=self.dtype, device=self.device)
        self.kv_caches = list(cache.unbind(0))
        self.num_blocks = num_blocks
        self.attention.use_cache(self.kv_caches[0])
        self.decode_graphs = None  # (captured over a cache, they read it alone)
        if self.drafter is not None:  # the same blocks: the block tables serve both
            self.drafter.initialize_kv_cache(num_blocks)

    def release_kv_cache(self) -> None:
        """Drop the cache (after the profiled steps that size the real one)."""
        self.kv_caches, self.num_blocks = [], 0
        self.attention.use_cache(None)
        self.decode_graphs = None  # (they read the cache released)
        if self.drafter is not None:
            self.drafter.release_kv_cache()

    # ------------------------------------------------------------------ one step
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        num_tokens = sum(scheduler_output.num_scheduled_tokens.values())
        # A lone sequence verifying drafts is one C call where a lone token is, so it runs
        # as a lone token does; other verifying steps run the torch forward.
        verify_one_thread = self._verify_one_thread or (
            self.lone_decode is not None and len(scheduler_output.num_scheduled_tokens) == 1)
        if not self._lone_token_one_thread or not (
                num_tokens == 1 or (verify_one_thread
                                    and scheduler_output.scheduled_spec_decode_tokens
                                    and num_tokens <= MAX_ONE_THREAD_VERIFY_TOKENS)):
            return self._execute_model(scheduler_output)
        with on_one_thread():  # see the module docstring
            return self._execute_model(scheduler_output)

    @torch.inference_mode()
    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        batch_update = self.batch.update(scheduler_output)
        self.sampler.update_state(batch_update)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = self.prepare_inputs(scheduler_output)
        logits: torch.Tensor | None = None  # the one call's, where it computed them
        if inputs.graph_step is not None:
            assert self.decode_graphs is not None
            hidden = self.decode_graphs.run(inputs.graph_step)
        elif (self.lone_decode is not None and not (self.lora and self.lora.is_active)
                and self.lone_decode.applies(inputs.input_ids, inputs.meta,
                                              one_sequence=len(inputs.scheduled) == 1)):
            hidden, logits = self.lone_decode(inputs.input_ids, inputs.positions,
                                               self.kv_caches, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                inputs.meta)
        if self.drafter is not None:
            self.drafter.run(scheduler_output)
        self.prompt_logprobs.discard(scheduler_output.finished_req_ids)
        self.prompt_logprobs.collect(self.model, hidden, inputs.scheduled)
        output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        if not inputs.sampled and not inputs.verified:
            return output
        if logits is None:  # (a lone decode's rows are those to sample or verify)
            logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        if inputs.verified:
            self._verify_drafts(logits[len(inputs.sampled):], inputs, output)
            logits = logits[:len(inputs.sampled)]
        if inputs.sampled:
            self._sample(logits, inputs, scheduler_output, output)
        if self.drafter is not None:
            self.drafter.propose(scheduler_output, output)
        return output

    def _verify_drafts(self, logits: torch.Tensor, inputs: StepInputs,
                       output: ModelRunnerOutput) -> None:
        """Speculative decoding: each drafting request's accepted drafts and next token,
        from the logits at its k + 1 positions (one target step verifies them all)."""
        items = inputs.verified
        layout = DraftLayout(np.array([len(item.drafts) for item in items], dtype=np.int64),
                             np.array([t for item in items for t in item.drafts],
                                      dtype=np.int64))
        tokens = self.sampler.verify_drafts(logits, [item.row for item in items], layout)
        for item, row_tokens in zip(items, tokens):
            if item.state.req_id in inputs.lora_errors:
                output.errors[item.state.req_id] = inputs.lora_errors[item.state.req_id]
                continue
            item.state.output_token_ids.extend(row_tokens)
            output.req_ids.append(item.state.req_id)
            output.sampled_token_ids.append(row_tokens[0])
            if len(row_tokens) > 1:
                output.more_token_ids[item.state.req_id] = row_tokens[1:]

    def _sample(self, logits: torch.Tensor, inputs: StepInputs,
                scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """One token for each request that reached the end of its known tokens."""
        rows = [item.row for item in inputs.sampled]
        apply_grammar_bitmask(logits, [item.state.req_id for item in inputs.sampled],
                              scheduler_output)
        wanted = logprobs.rows_wanting_logprobs([item.state for item in inputs.sampled])
        raw = logprobs.raw_logprobs(logits, wanted)  # before the sampler changes the logits
        step = self.sampler.sample_on_device(logits, rows)
        token_ids, errors, entries = self._read_back(step, raw, [inputs.sampled[i]
                                                                 for i in wanted], wanted)
        for item, token_id in zip(inputs.sampled, token_ids):
            # Kept even for a failed row: the engine core fails its request, but under
            # --async-scheduling a step scheduled behind this one may still compute it.
            item.state.output_token_ids.append(token_id)
            if item.row in errors or item.state.req_id in inputs.lora_errors:
                output.errors[item.state.req_id] = errors.get(
                    item.row, inputs.lora_errors.get(item.state.req_id, ""))
                continue
            output.req_ids.append(item.state.req_id)
            output.sampled_token_ids.append(token_id)
            prompt_logprobs = self.prompt_logprobs.take(item.state.req_id)
            if prompt_logprobs is not None:
                output.prompt_logprobs[item.state.req_id] = prompt_logprobs
        for i, entry in zip(wanted, entries):
            if inputs.sampled[i].row not in errors:
                output.logprobs[inputs.sampled[i].state.req_id] = entry

    def _read_back(self, step: StepSample, raw: torch.Tensor | None, items: list[_Scheduled],
                   wanted: list[int]) -> tuple[list[int], dict[int, str], list[TokenLogprobs]]:
        """The step's one read from the device: the sampled tokens, whether each could be
        sampled, and the logprobs of the rows that asked, in one copy."""
        num_top = [item.state.sampling_params.logprobs or 0 for item in items]
        parts = [step.tokens.double(), step.ok.double()]
        if raw is not None:
            chosen = step.tokens[self._to_device(np.array(wanted, dtype=np.int64))
                                 if len(wanted) < len(step.tokens) else slice(None)]
            parts.append(logprobs.gather_on_device(raw, chosen, num_top))
        values = torch.cat(parts).tolist()
        num_rows = len(step.rows)
        token_ids, errors = step.finish(values[:num_rows], values[num_rows:2 * num_rows])
        entries = [] if raw is None else logprobs.unpack(values[2 * num_rows:], num_top)
        return token_ids, errors, entries

    def _scheduled(self, scheduler_output: SchedulerOutput) -> list[_Scheduled]:
        """The step's requests: single-token queries first, then prefill chunks (fresh
        prompts grouped by length, then those continuing a cached context)."""
        items = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.batch.requests.get(req_id)
            if state is None:
                raise ValueError(f"Request {req_id!r} is scheduled but the worker does not "
                                 f"hold it")
            start = state.num_computed_tokens
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            if num_tokens < 1 or start + num_tokens - len(drafts) > state.num_tokens:
                raise ValueError(f"Request {req_id!r}: {num_tokens} tokens scheduled from "
                                 f"{start}, but it has {state.num_tokens}")
            items.append(_Scheduled(state, self.batch.req_id_to_row[req_id], start, num_tokens,
                                    drafts))
        # A row verifying drafts is a decode too: each of its tokens one query (below).
        return sorted(items, key=lambda s: (s.num_tokens - len(s.drafts) > 1, s.start > 0,
                                            s.num_tokens))

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        items = self._scheduled(scheduler_output)
        counts = np.array([s.num_tokens for s in items], dtype=np.int64)
        starts = np.array([s.start for s in items], dtype=np.int64)
        rows = np.array([s.row for s in items], dtype=np.int64)
        offsets = np.cumsum(counts) - counts  # first flat index of each request
        total = int(counts.sum())
        positions = np.arange(total) - np.repeat(offsets - starts, counts)
        token_rows = np.repeat(rows, counts)
        block_size = self.block_size
        slots = (self.batch.block_table[token_rows, positions // block_size] * block_size
                 + positions % block_size)
        token_ids = list(itertools.chain.from_iterable(
            s.state.token_ids(s.start, s.start + s.num_tokens - len(s.drafts)) + s.drafts
            for s in items))
        reach_end = [i for i, s in enumerate(items)
                     if s.start + s.num_tokens - len(s.drafts) == s.state.num_tokens]
        sampled = [i for i in reach_end if not items[i].drafts]
        verified = [i for i in reach_end if items[i].drafts]
        # Logits: the sampled requests' last token, then each verifying one's k + 1.
        num_verified = np.array([len(items[i].drafts) + 1 for i in verified], dtype=np.int64)
        logits_positions = np.concatenate([
            offsets[sampled] + counts[sampled] - 1,
            np.repeat(offsets[verified] + counts[verified] - num_verified, num_verified)
            + ranks(num_verified)])
        lora_errors: dict[str, str] = {}
        if self.lora is not None:
            failed = self.lora.select([s.state.sampling_params.lora_request for s in items],
                                      counts)
            lora_errors = {items[i].state.req_id: error for i, error in failed.items()}
        graph_size = None if self.decode_graphs is None or (
            self.lora is not None and self.lora.is_active) else \
            self.decode_graphs.bucket_for(counts)
        if graph_size is not None:  # a pure decode step: padded, into the graphs' buffers
            return StepInputs(
                input_ids=_NO_ROWS, positions=_NO_ROWS, meta=AttentionMetadata(
                    write_index=_NO_ROWS, block_size=block_size),
                logits_indices=self._to_device(np.array(sampled, dtype=np.int64)),
                sampled=[items[i] for i in sampled], scheduled=items,
                graph_step=pad_decode_step(np.array(token_ids, dtype=np.int64), starts,
                                           self.batch.block_table[rows], block_size,
                                           graph_size),
                lora_errors=lora_errors)
        if self.triton_attention:  # the Triton kernels read the block table in place
            meta = AttentionMetadata(write_index=_NO_ROWS, block_size=block_size, triton=(
                build_triton_metadata(counts, starts, self.batch.block_table[rows],
                                      block_size).to(self.device)))
        else:
            meta = self.attention.metadata(slots)
            num_known = counts if not verified else \
                counts - np.array([len(s.drafts) for s in items], dtype=np.int64)
            num_decodes = int(np.searchsorted(num_known > 1, True))  # decodes come first
            if num_decodes:
                decode_rows, decode_lens = rows[:num_decodes], starts[:num_decodes] + 1
                if verified:
                    # Token j of a row verifying drafts is a query of its own, over the
                    # row's blocks up to its position (the step writes every token's KV
                    # first).
                    decode_counts = counts[:num_decodes]
                    decode_rows = np.repeat(decode_rows, decode_counts)
                    decode_lens = (np.repeat(starts[:num_decodes], decode_counts)
                                   + ranks(decode_counts) + 1)
                self.attention.add_decodes(meta, decode_rows, decode_lens)
            self.attention.add_prefills(meta, items[num_decodes:], int(offsets[num_decodes])
                                        if num_decodes < len(items) else total)
        return StepInputs(
            input_ids=self._to_device(np.array(token_ids, dtype=np.int64)),
            positions=self._to_device(positions),
            meta=meta,
            logits_indices=self._to_device(logits_positions),
            sampled=[items[i] for i in sampled], scheduled=items,
            verified=[items[i] for i in verified], lora_errors=lora_errors)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
