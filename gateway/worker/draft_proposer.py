"""Draft-model speculative decoding (worker process): a small model of the target's
vocabulary proposes the tokens the target verifies in its next step (`DraftProposer`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from gateway.messages import ModelRunnerOutput, SchedulerOutput
from gateway.models.layers.attention import AttentionMetadata
from gateway.models.layers.triton_attention import build_triton_metadata
from gateway.worker.host_buffers import to_device
from gateway.worker.model_runner import ModelRunner


class DraftProposer:
    """The draft keeps a KV cache of its own with the target's block count and block size,
    so the target's block tables and slot mapping serve both. Each step it runs on the
    step's flat tokens right after the target (same tokens, positions and blocks), so its
    cache holds every position the target's does: prompt chunks, verified tokens (a rejected
    draft's slot is written again later, as the target's is). Then, for each row the
    scheduler let draft (it sampled this step and holds lookahead slots), k batched greedy
    decode steps of the draft propose k tokens: the row's newest token at its position, its
    argmax next, and so on. Those proposals write the draft's KV up to k - 1 slots past the
    newest token: the lookahead slots, written again when the target verifies them next
    step."""

    def __init__(self, model: nn.Module, target: ModelRunner,
                 num_speculative_tokens: int) -> None:
        # A runner of the draft builds its attention metadata (its own KV heads and cache)
        # over the target's rows and block tables; it never samples.
        self.runner = ModelRunner(model, target.sampler, target.device, target.dtype,
                                  target.block_size, target.max_model_len, target.batch)
        self.num_speculative_tokens = num_speculative_tokens

    # ------------------------------------------------------------------ KV cache
    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def release_kv_cache(self) -> None:
        self.runner.release_kv_cache()

    # ------------------------------------------------------------------ one step
    def run(self, scheduler_output: SchedulerOutput) -> None:
        """The draft over the step's tokens (before the target appends its new ones, which
        the layout depends on): only its KV cache is wanted."""
        inputs = self.runner.prepare_inputs(scheduler_output)
        self.runner.model(inputs.input_ids, inputs.positions, self.runner.kv_caches,
                          inputs.meta)

    def propose(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """k greedy proposals for each row the scheduler let draft that got its token(s)
        this step, into `output.draft_token_ids`."""
        allowed = set(scheduler_output.draft_req_ids)
        req_ids = [req_id for req_id in output.req_ids if req_id in allowed]
        if not req_ids:
            return
        batch = self.runner.batch
        rows = np.array([batch.req_id_to_row[req_id] for req_id in req_ids], dtype=np.int64)
        states = [batch.requests[req_id] for req_id in req_ids]
        positions = np.array([state.num_tokens - 1 for state in states], dtype=np.int64)
        token_ids = to_device(np.array([state.output_token_ids[-1] for state in states],
                                       dtype=np.int64), self.runner.device)
        proposed = []
        for step in range(self.num_speculative_tokens):
            token_ids = self._decode(token_ids, positions + step, rows)
            proposed.append(token_ids)
        values = torch.stack(proposed, dim=1).tolist()  # the one read from the device
        output.draft_token_ids = dict(zip(req_ids, values))

    def _decode(self, token_ids: torch.Tensor, positions: np.ndarray,
                rows: np.ndarray) -> torch.Tensor:
        """One decode step of the draft: each row's token at its position -> its argmax."""
        runner = self.runner
        meta = self._decode_metadata(positions, rows)
        device_positions = to_device(positions, runner.device)
        logits = None
        lone = runner.lone_decode
        if lone is not None and lone.applies(token_ids, meta):
            hidden, logits = lone(token_ids, device_positions, runner.kv_caches, meta)
        else:
            hidden = runner.model(token_ids, device_positions, runner.kv_caches, meta)
        if logits is None:
            logits = runner.model.compute_logits(hidden)
        return logits.argmax(dim=-1)

    def _decode_metadata(self, positions: np.ndarray, rows: np.ndarray) -> AttentionMetadata:
        runner = self.runner
        if runner.triton_attention:
            return AttentionMetadata(
                write_index=torch.empty(0, dtype=torch.int64), block_size=runner.block_size,
                triton=build_triton_metadata(np.ones(len(rows), dtype=np.int64), positions,
                                             runner.batch.block_table[rows],
                                             runner.block_size).to(runner.device))
        return runner.attention.decodes(positions, rows)
