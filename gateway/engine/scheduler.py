"""Continuous batching (engine-core process): which requests run each step, and how many
tokens each computes.

Each step: running requests first (decode, or the next chunk of a long prompt), then
waiting ones while the token budget, the running-sequence cap and the KV cache allow. A
part-scheduled prompt is always the last running request, so the decodes before it get
their token every step (chunked prefill never stalls decoding). A request that cannot get
a block preempts the latest running one by recompute (policy "priority": queue and batch
in (priority, arrival) order). A request's cached leading blocks are skipped; blocks enter
the cache after the step that computed them. docs/prefix-caching.md, docs/reliability.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from gateway.config import SchedulerConfig
from gateway.engine.kv_cache_manager import KVCacheManager
from gateway.engine.request import Request, RequestStatus
from gateway.engine.stats import IterationStatsCollector
from gateway.messages import (
    CachedRequestData,
    EngineCoreOutput,
    IterationStats,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                 eos_token_ids: Iterable[int], log_stats: bool = True,
                 max_loras: int | None = None, num_lookahead_tokens: int = 0) -> None:
        self.config = config
        #: Draft model: KV slots a drafting row holds past its step's tokens, where the
        #: worker writes the draft's KV while proposing (0: no draft model).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # for the worker to drop, sent with the next step
        self._num_preemptions = 0
        self._expired: list[EngineCoreOutput] = []  # refused by the queue deadline
        self.stats_collector = IterationStatsCollector() if log_stats else None
        self.max_loras = max_loras  # distinct LoRA adapters the running requests may hold
        self._in_flight: deque[_StepInFlight] = deque()  # --async-scheduling, oldest first

    # ------------------------------------------------------------------ requests in and out
    @property
    def is_priority(self) -> bool:
        return self.config.policy == "priority"

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self.is_priority:
            self._enqueue_by_priority(request)
        else:
            self.waiting.append(request)

    def _enqueue_by_priority(self, request: Request) -> None:
        """Into the queue after every request that goes before it."""
        key = _priority_key(request)
        index = next((i for i, other in enumerate(self.waiting)
                      if _priority_key(other) > key), len(self.waiting))
        self.waiting.insert(index, request)

    def abort_requests(self, request_ids: Iterable[str], reason: str = "abort") -> list[str]:
        """Finish these requests now, freeing their cache; return the ids that were live.
        `reason` is the finish reason the stats record ("stop" for a stop string)."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, reason)
                aborted.append(request_id)
        return aborted

    def fail_requests(self, request_ids: Iterable[str], error: str) -> list[EngineCoreOutput]:
        return [EngineCoreOutput(rid, [], "error", error=error, error_kind="internal")
                for rid in self.abort_requests(request_ids, "error")]

    def has_requests(self) -> bool:
        return bool(self.requests)

    def can_hold(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt of this length (plus one generated token) fits the whole cache."""
        return self.kv_cache.blocks_needed(0, num_prompt_tokens + 1) <= self.kv_cache.num_blocks

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        # Prompt tokens this step may take, besides the one token of each decoding row:
        # the whole budget for a request alone, else the cap.
        cap = self.config.max_num_prefill_tokens
        prefill_left = budget if cap is None or len(self.running) + len(self.waiting) <= 1 \
            else cap
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        may_draft: list[tuple[Request, int]] = []  # draft model: (request, its lookahead end)
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False
        if self.is_priority:  # the last running request is the first to preempt
            self.running.sort(key=_priority_key)

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_output_placeholders and self._waits_for_its_token(request):
                index += 1
                continue
            num_tokens = min(request.num_tokens_to_compute, budget)
            if num_tokens > 1:
                if prefill_left <= 0:
                    index += 1  # its next chunk waits; the decoding rows behind it run
                    continue
                num_tokens = min(num_tokens, prefill_left)
            drafts = self._fit_drafts(request, num_tokens, budget)
            preemptions_before = self._num_preemptions
            new_blocks = self._allocate_or_preempt(request, num_tokens + len(drafts))
            preempted |= self._num_preemptions != preemptions_before
            if new_blocks is None:  # the request preempted itself
                break
            if self._samples(request, num_tokens):
                may_draft.append((request, request.num_computed_tokens + num_tokens
                                  + len(drafts) + self.num_lookahead_tokens))
            self._add_scheduled(request, num_tokens, new_blocks, new_reqs, cached_reqs)
            num_scheduled[request.request_id] = num_tokens + len(drafts)
            if drafts:
                spec_tokens[request.request_id] = drafts
            budget -= num_tokens + len(drafts)
            if num_tokens > 1:
                prefill_left -= num_tokens
            index += 1

        running_loras = self.running_loras()
        skipped: list[Request] = []  # waiting for a LoRA slot: those behind may start
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted while a step of its ran: it restarts once its token is in
            if prefill_left <= 0 and request.pooling_params is None:
                break  # no prompt tokens left this step: it starts next step
            lora = request.lora_request
            if (lora is not None and self.max_loras is not None
                    and lora.lora_int_id not in running_loras
                    and len(running_loras) >= self.max_loras):
                skipped.append(self.waiting.popleft())
                continue
            admitted = self._admit(request, budget, prefill_left)
            if admitted is None:
                break  # it waits for budget or blocks; it is never dropped
            num_tokens, new_blocks = admitted
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if self.stats_collector is not None:
                self.stats_collector.on_scheduled(request, time.time())
            self.running.append(request)
            if lora is not None:
                running_loras.add(lora.lora_int_id)
            if self._samples(request, num_tokens):
                may_draft.append((request, request.num_computed_tokens + num_tokens
                                  + self.num_lookahead_tokens))
            self._add_scheduled(request, num_tokens, new_blocks, new_reqs, cached_reqs)
            num_scheduled[request.request_id] = num_tokens
            budget -= num_tokens
            if num_tokens > 1 and request.pooling_params is None:
                prefill_left -= num_tokens

        self.waiting.extendleft(reversed(skipped))  # back at the head, in their order
        draft_req_ids = self._reserve_lookahead(may_draft, new_reqs, cached_reqs)
        # After admission: a request that can start now starts, however long it waited.
        self._expire_waiting()
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                               num_scheduled_tokens=num_scheduled, finished_req_ids=finished,
                               scheduled_spec_decode_tokens=spec_tokens,
                               draft_req_ids=draft_req_ids)

    def _waits_for_its_token(self, request: Request) -> bool:
        """--async-scheduling: whether a request with a token in flight must wait for it
        before its next step: a grammar's bitmask depends on it, or it surely ends the
        request (max_tokens, the context length)."""
        num_pending = request.num_output_placeholders
        return (request.sampling_params.structured_outputs is not None
                or len(request.output_token_ids) + num_pending >= request.max_tokens
                or request.num_tokens + num_pending >= self.max_model_len)

    def mark_in_flight(self, scheduler_output: SchedulerOutput) -> None:
        """--async-scheduling: `scheduler_output` is submitted and its outputs come later.
        Advance its requests past it now, a placeholder for each token it samples, so the
        next schedule can run them again (the worker feeds a row its own sampled token),
        unless `_waits_for_its_token`. A token that lands for a request finished
        meanwhile is dropped, and its blocks are already free."""
        sampling_ids = []
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            if request.num_tokens_to_compute == 0 and request.pooling_params is None:
                request.num_output_placeholders += 1
                sampling_ids.append(request_id)
        self._in_flight.append(_StepInFlight(scheduler_output.num_scheduled_tokens,
                                             sampling_ids))

    def _land_oldest_step(self) -> set[str]:
        """--async-scheduling: the oldest step in flight is done. Its placeholders give way
        to the tokens now known, and the blocks it completed enter the prefix cache (not
        those of a later step still in flight). Returns the requests it sampled."""
        step = self._in_flight.popleft()
        for request_id in step.sampling_ids:
            request = self.requests.get(request_id)
            if request is not None:
                request.num_output_placeholders -= 1
        for request_id in step.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                num_later = sum(later.num_scheduled_tokens.get(request_id, 0)
                                for later in self._in_flight)
                self.kv_cache.cache_blocks(request, request.num_computed_tokens - num_later)
        return set(step.sampling_ids)

    def fail_step(self, scheduler_output: SchedulerOutput,
                  error: str) -> list[EngineCoreOutput]:
        """The step failed: fail every request in it."""
        if self.config.async_scheduling:
            self._in_flight.popleft()
        return self.fail_requests(list(scheduler_output.num_scheduled_tokens), error)

    def keep_finished_ids(self, request_ids: list[str]) -> None:
        """Finished ids an empty schedule took but no step carried: for the next step."""
        self._finished_ids[:0] = request_ids

    def running_loras(self) -> set[int]:
        """The LoRA adapters (ids) of the running requests: at most --max-loras."""
        return {request.lora_request.lora_int_id for request in self.running
                if request.lora_request is not None}

    def _expire_waiting(self) -> None:
        """Refuse the waiting requests past their queue deadline that never ran."""
        if not self.waiting:
            return
        now = time.time()
        expired = []
        for request in self.waiting:
            limit = self._queue_limit(request)
            # In the queue with no preemption: it never ran (nor did its fan-out).
            if (limit is not None and request.num_preemptions == 0
                    and not request.sibling_started
                    and now - request.arrival_time > limit[0]):
                expired.append((request, limit))
        for request, (seconds, whose) in expired:
            self._finish(request, "abort", now)
            self._expired.append(EngineCoreOutput(
                request.request_id, [], "error", error_kind="queue_timeout",
                error=f"the request waited {now - request.arrival_time:.1f} s in the queue, "
                      f"over the limit of {seconds:g} s ({whose})"))

    def _queue_limit(self, request: Request) -> tuple[float, str] | None:
        """How long `request` may wait, and whose limit that is: the shorter of the
        server's and the request's own; None: no limit."""
        own = request.sampling_params.max_queue_time
        server = self.config.max_queue_time
        if own is not None and (server is None or own < server):
            return own, "the request's max_queue_time"
        return None if server is None else (server, "--max-queue-time")

    def take_expired(self) -> list[EngineCoreOutput]:
        """The requests the queue deadline refused since the last call."""
        expired, self._expired = self._expired, []
        return expired

    def _admit(self, request: Request, budget: int,
               prefill_left: int) -> tuple[int, list[int]] | None:
        """Room for a waiting request this step, after its cached prefix: (tokens to
        compute, new blocks), or None when it must wait. An encoder's prompt counts
        against `budget` only; a generating request's, against `prefill_left` too."""
        if request.pooling_params is not None:
            if request.num_tokens > budget:
                return None  # an encoder reads its whole prompt at once: next step
            return request.num_tokens, []  # an encoder keeps no KV cache
        computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
        num_tokens = min(request.num_tokens - num_cached, budget, prefill_left)
        new_blocks = self.kv_cache.allocate(request, num_cached + num_tokens, computed_blocks)
        if new_blocks is None:
            return None
        self.kv_cache.record_lookup(request, num_cached)
        request.num_computed_tokens = num_cached  # the worker starts after the hit
        return num_tokens, new_blocks

    def _fit_drafts(self, request: Request, num_tokens: int, budget: int) -> list[int]:
        """The request's drafts that this step verifies: all of them when it decodes and
        the budget and the free blocks hold them (drafts never preempt anyone); they are
        taken either way, and the next drafts are proposed after the step."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if num_tokens != 1 or not drafts:
            return []
        drafts = drafts[:budget - 1]
        needed = self.kv_cache.blocks_needed(
            len(request.block_ids), request.num_computed_tokens + 1 + len(drafts))
        return drafts if needed <= self.kv_cache.num_free_blocks else []

    def _samples(self, request: Request, num_tokens: int) -> bool:
        """Draft model: whether `request` samples a token this step and may take drafts
        (the worker then proposes them, if its lookahead slots are free)."""
        return (self.num_lookahead_tokens > 0 and request.can_speculate
                and request.num_computed_tokens + num_tokens == request.num_tokens)

    def _reserve_lookahead(self, may_draft: list[tuple[Request, int]],
                           new_reqs: list[NewRequestData],
                           cached_reqs: list[CachedRequestData]) -> list[str]:
        """Draft model: the requests the worker proposes drafts for after this step, each
        holding the lookahead slots the proposals write, up to its end. Taken once the
        step is scheduled, from the blocks still free and within the context length, so
        they never preempt nor hold back a request's tokens; a request without them takes
        no drafts next step. They are released after the step (the proposals' draft KV is
        written again when the target verifies them)."""
        if not may_draft:
            return []
        entries: dict[str, NewRequestData | CachedRequestData] = {
            entry.req_id: entry for entry in new_reqs}
        entries.update((entry.req_id, entry) for entry in cached_reqs)
        allowed = []
        for request, end in may_draft:
            blocks = None if end > self.max_model_len else self.kv_cache.allocate(request, end)
            if blocks is None:
                continue
            entry = entries[request.request_id]
            if isinstance(entry, NewRequestData):
                entry.block_ids.extend(blocks)
            else:
                entry.new_block_ids.extend(blocks)
                entry.num_blocks = len(request.block_ids)
            allowed.append(request.request_id)
        return allowed

    def _allocate_or_preempt(self, request: Request, num_tokens: int) -> list[int] | None:
        while True:
            new_blocks = self.kv_cache.allocate(request, request.num_computed_tokens + num_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)  # its computed full blocks stay cached until evicted
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        request.is_new_to_worker = True
        if self.is_priority:
            self._enqueue_by_priority(request)
        else:
            self.waiting.appendleft(request)
        self._finished_ids.append(request.request_id)
        self._num_preemptions += 1

    @staticmethod
    def _add_scheduled(request: Request, num_tokens: int, new_blocks: list[int],
                       new_reqs: list[NewRequestData],
                       cached_reqs: list[CachedRequestData]) -> None:
        if request.is_new_to_worker:
            new_reqs.append(NewRequestData(
                req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params, block_ids=list(request.block_ids),
                output_token_ids=list(request.output_token_ids),
                num_computed_tokens=request.num_computed_tokens,
                pooling_params=request.pooling_params))
            request.is_new_to_worker = False
        else:
            cached_reqs.append(CachedRequestData(
                req_id=request.request_id, new_block_ids=new_blocks,
                num_computed_tokens=request.num_computed_tokens,
                num_blocks=len(request.block_ids)))

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance each scheduled request; append sampled tokens; finish the done ones.
        Under --async-scheduling `scheduler_output` is the oldest step in flight (never
        with drafts: the two are refused together)."""
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        landed: set[str] = set()  # sampled by this step: kept if preempted since
        if self.config.async_scheduling:
            landed = self._land_oldest_step()
        else:
            for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                request = self.requests.get(request_id)
                if request is not None and request.status is RequestStatus.RUNNING:
                    # Drafts count once accepted (below); a row's last known token now.
                    request.num_computed_tokens += (num_tokens
                                                    - len(spec_tokens.get(request_id, ())))
                    if request_id not in spec_tokens:
                        self.kv_cache.cache_blocks(request)  # their KV is computed now
        now = time.time()
        outputs = self._finish_pooled(scheduler_output, runner_output, now)
        for request_id, token_id in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(request_id)
            if request is None or (request.status is not RequestStatus.RUNNING
                                   and request_id not in landed):
                continue  # aborted, finished or preempted while the step ran
            token_ids = [token_id, *runner_output.more_token_ids.get(request_id, ())]
            outputs.append(self._append_tokens(request, token_ids,
                                               spec_tokens.get(request_id), now))
        for request_id, error in runner_output.errors.items():
            outputs += self.fail_requests([request_id], error)
        for request_id in scheduler_output.draft_req_ids:  # their lookahead slots
            request = self.requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                self.kv_cache.release_unused(request)
        return outputs

    def _append_tokens(self, request: Request, token_ids: list[int],
                       drafts: list[int] | None, now: float) -> EngineCoreOutput:
        """Append the step's tokens one by one, as if sampled in separate steps: a stop
        condition met part-way drops the rest. With drafts, the accepted ones' KV counts
        as computed and blocks that held only rejected ones are released."""
        new_ids: list[int] = []
        finish_reason, stop_reason = None, None
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            new_ids.append(token_id)
            finish_reason, stop_reason = self._check_stop(request, token_id)
            if finish_reason is not None:
                break
        if self.stats_collector is not None:
            self.stats_collector.on_token(request, now, len(new_ids))
            if drafts:
                self.stats_collector.on_drafts_verified(len(drafts), len(token_ids) - 1)
        if drafts is not None:
            request.num_computed_tokens = min(request.num_computed_tokens + len(token_ids) - 1,
                                              request.num_tokens - 1)
            self.kv_cache.cache_blocks(request)
            self.kv_cache.release_unused(request)
        if finish_reason is not None:
            self._finish(request, finish_reason, now)
        return EngineCoreOutput(request.request_id, new_ids, finish_reason, stop_reason)

    def _finish_pooled(self, scheduler_output: SchedulerOutput,
                       runner_output: ModelRunnerOutput, now: float) -> list[EngineCoreOutput]:
        """End the pooling requests of this step: with their vector, or failed when the
        runner gave none (a pooling request never runs a second step)."""
        outputs = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.pooling_params is None \
                    or request.status is not RequestStatus.RUNNING:
                continue
            vector = runner_output.pooler_outputs.get(request_id)
            if vector is None:
                if request_id not in runner_output.errors:
                    outputs += self.fail_requests([request_id], "the model runner returned no "
                                                  "pooled output for this request")
                continue
            if self.stats_collector is not None:
                self.stats_collector.on_pooled(request)
            outputs.append(EngineCoreOutput(request_id, [], "stop", pooling_output=vector))
            self._finish(request, "stop", now)
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> tuple[str | None, int | None]:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return "stop", token_id
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return "stop", None
        if num_output >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _finish(self, request: Request, reason: str, now: float | None = None) -> None:
        if self.stats_collector is not None:
            self.stats_collector.on_finished(request, reason, now)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def make_stats(self) -> SchedulerStats:
        stats = SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage, num_free_blocks=self.kv_cache.num_free_blocks,
            num_total_blocks=self.kv_cache.num_blocks, num_preemptions=self._num_preemptions,
            prefix_cache_stats=self.kv_cache.take_stats())
        if self.max_loras is not None:
            stats.running_lora_adapters = _count_loras(self.running)
            stats.waiting_lora_adapters = _count_loras(self.waiting)
        self._num_preemptions = 0
        return stats

    def take_iteration_stats(self) -> IterationStats | None:
        """The iteration stats since the last call; None when off or nothing happened."""
        return None if self.stats_collector is None else self.stats_collector.take()


class _StepInFlight(NamedTuple):
    num_scheduled_tokens: dict[str, int]
    sampling_ids: list[str]  # the requests holding a placeholder for this step's token


def _count_loras(requests: Iterable[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts


def _priority_key(request: Request) -> tuple[int, float]:
    """The order of policy "priority": lower priority value first, then earlier arrival."""
    return request.sampling_params.priority, request.arrival_time
