"""EngineCore: the engine-core process's work, as a plain class tests drive in-process.

One step is a recipe: schedule, execute, update, emit. With --async-scheduling the core
keeps up to two steps in flight: it schedules and submits step N+1, then takes step N's
outputs, so the scheduler runs while the worker computes (docs/gpu.md).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from gateway.config import CPU_MAX_NUM_PREFILL_TOKENS, EngineConfig
from gateway.engine.kv_cache_manager import KVCacheManager
from gateway.engine.ngram_proposer import NgramProposer, can_speculate
from gateway.engine.request import Request
from gateway.engine.scheduler import Scheduler
from gateway.engine.structured_output.manager import StructuredOutputManager
from gateway.executor import ExecutorDeadError, make_executor
from gateway.logger import init_logger
from gateway.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineHandshake,
    IterationStats,
    ModelRunnerOutput,
    SchedulerOutput,
)
from gateway.plugins import load_report
from gateway.sampling_params import InvalidParameterError

logger = init_logger(__name__)

MAX_STEPS_IN_FLIGHT = 2  # --async-scheduling: the step running and the one scheduled behind


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        from gateway.worker.logits_processors import processor_classes_for_validation

        self.config = config
        self.executor = make_executor(config)
        block_size = config.cache.block_size
        self.supported_tasks = tuple(self.executor.supported_tasks)
        capacity = self.executor.num_kv_blocks * block_size
        if not self.executor.num_kv_blocks and "generate" not in self.supported_tasks:
            capacity = self.executor.max_model_len  # an encoder: no KV cache to fill
            _check_encoder_budget(config, capacity)
        if self.executor.num_kv_blocks:
            logger.info("%s", kv_capacity_line(self.executor.device_type,
                                               self.executor.num_kv_blocks, block_size,
                                               self.executor.max_model_len))
        self.max_model_len = min(self.executor.max_model_len, capacity)
        if self.max_model_len < self.executor.max_model_len:
            logger.warning("The KV cache holds %d tokens, less than the model's context length "
                           "%d: requests are limited to %d tokens.", capacity,
                           self.executor.max_model_len, self.max_model_len)
        self.eos_token_ids = self.executor.eos_token_ids  # the worker read the tokenizer
        kv_cache = KVCacheManager(self.executor.num_kv_blocks, block_size,
                                  enable_caching=config.cache.enable_prefix_caching,
                                  hash_seed=f"{config.model.model}\0{config.model.dtype}")
        if config.scheduler.async_scheduling and "generate" not in self.supported_tasks:
            logger.warning("--async-scheduling is ignored: a pooling model's request runs "
                           "one step, so there is no next step to schedule early")
            config.scheduler.async_scheduling = False
        self._in_flight: deque[SchedulerOutput] = deque()  # --async-scheduling
        if config.scheduler.max_num_prefill_tokens is None \
                and self.executor.device_type == "cpu":
            config.scheduler.max_num_prefill_tokens = CPU_MAX_NUM_PREFILL_TOKENS
        speculative = config.speculative if "generate" in self.supported_tasks else None
        self.speculative = speculative  # None: one token a step
        self.scheduler = Scheduler(config.scheduler, kv_cache, self.max_model_len,
                                   self.eos_token_ids, log_stats=config.log_stats,
                                   max_loras=None if config.lora is None
                                   else config.lora.max_loras,
                                   num_lookahead_tokens=speculative.num_speculative_tokens
                                   if speculative is not None and speculative.uses_draft_model
                                   else 0)
        self.processor_classes = processor_classes_for_validation(config.model)
        self.vocab_size = self.executor.vocab_size
        self.structured = StructuredOutputManager(config.model, self.vocab_size,
                                                  list(self.eos_token_ids),
                                                  config.structured_outputs)
        # N-gram drafts are proposed here; a draft model's come with the worker's outputs.
        self.proposer = None if speculative is None or speculative.uses_draft_model \
            else NgramProposer(speculative)
        if speculative is not None and self.processor_classes:
            logger.warning("Speculative decoding is configured, but logits processors are "
                           "loaded: every request runs without drafts.")

    def handshake(self, pid: int) -> EngineHandshake:
        return EngineHandshake(
            supported_tasks=list(self.supported_tasks), max_model_len=self.max_model_len,
            num_kv_blocks=self.executor.num_kv_blocks, block_size=self.config.cache.block_size,
            eos_token_ids=list(self.eos_token_ids), vocab_size=self.vocab_size,
            plugin_reports=load_report().to_dicts() + self.executor.plugin_reports(), pid=pid,
            processes={self.config.parallel.engine_role: pid,
                       **getattr(self.executor, "local_worker_pids", {})})

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request; return an error output instead when it cannot run."""
        try:
            self._validate(request)
        except InvalidParameterError as exc:
            return EngineCoreOutput(request.request_id, [], "error", error=str(exc),
                                    error_kind="invalid_request", error_param=exc.param)
        queued = Request(request, self.max_model_len)
        queued.can_speculate = (self.speculative is not None
                                and request.pooling_params is None
                                and can_speculate(request.sampling_params,
                                                  bool(self.processor_classes)))
        if request.pooling_params is None and request.sampling_params.structured_outputs:
            # Waits for its grammar outside the scheduler; joins it once compiled.
            self.structured.add_request(queued)
        else:
            self.scheduler.add_request(queued)
        return None

    def _validate(self, request: EngineCoreRequest) -> None:
        from gateway.worker.logits_processors import validate_request

        prompt = request.prompt_token_ids
        task = "generate" if request.pooling_params is None else request.pooling_params.task
        if task not in self.supported_tasks:
            raise InvalidParameterError("model", f"this model does not support the task "
                                        f"{task!r}; it supports {', '.join(self.supported_tasks)}")
        if not prompt:
            raise InvalidParameterError("prompt", "the prompt is empty")
        priority = request.sampling_params.priority
        if priority != 0 and self.scheduler.config.policy != "priority":
            raise InvalidParameterError("priority", f"got priority {priority}, but priority "
                                        "scheduling is not enabled (--scheduling-policy "
                                        "priority)")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameterError("prompt", f"token ids {bad[:5]} are outside the "
                                        f"vocabulary (0..{self.vocab_size - 1})")
        # A generated token needs room after the prompt; a pooled prompt needs none.
        limit = self.max_model_len - (request.pooling_params is None)
        if len(prompt) > limit:
            raise InvalidParameterError("prompt", f"the prompt has {len(prompt)} tokens; the "
                                        f"maximum context length is {self.max_model_len}")
        if request.pooling_params is not None:
            return
        request.sampling_params.validate()
        validate_request(self.processor_classes, request.sampling_params,
                         vocab_size=self.vocab_size)
        structured = request.sampling_params.structured_outputs
        if structured is not None:
            try:
                structured.kind_and_spec()
            except ValueError as exc:
                raise InvalidParameterError(structured.source_param, str(exc)) from None

    def abort_requests(self, request_ids: list[str], reason: str = "abort") -> None:
        self.scheduler.abort_requests(request_ids, reason)
        self.structured.abort(request_ids)

    def has_work(self) -> bool:
        return (self.scheduler.has_requests() or self.structured.has_waiting()
                or bool(self._in_flight))

    def check_health(self) -> None:
        """Raise ExecutorDeadError when a worker process is gone (the loop calls it while
        idle; during a step the executor notices by itself)."""
        self.executor.check_health()

    # ------------------------------------------------------------------ one step
    def step(self) -> EngineCoreOutputs:
        """Admit requests whose grammar is ready, schedule, execute, update, emit."""
        if self.config.scheduler.async_scheduling:
            return self.step_async()
        outputs = self.structured.take_ready(
            self.scheduler.add_request, wait_s=0.0 if self.scheduler.has_requests() else 0.02)
        scheduler_output = self.scheduler.schedule()
        outputs += self.scheduler.take_expired()  # refused by --max-queue-time
        if not scheduler_output.num_scheduled_tokens:
            return self.make_outputs(outputs)
        self.structured.attach_bitmask(scheduler_output, self.scheduler.requests)
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except ExecutorDeadError:
            raise  # a worker is gone: the engine core ends (the front end fails requests)
        except Exception as exc:
            return self.make_outputs(outputs + self._fail_step(scheduler_output, exc))
        return self.make_outputs(outputs + self._update(scheduler_output, runner_output))

    def step_async(self) -> EngineCoreOutputs:
        """--async-scheduling: schedule and submit steps until two are in flight, then
        take the oldest one's outputs, update, emit."""
        outputs = self.structured.take_ready(self.scheduler.add_request, wait_s=0.0 if (
            self.scheduler.has_requests() or self._in_flight) else 0.02)
        while len(self._in_flight) < MAX_STEPS_IN_FLIGHT:
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.num_scheduled_tokens:
                self.scheduler.keep_finished_ids(scheduler_output.finished_req_ids)
                break
            self.structured.attach_bitmask(scheduler_output, self.scheduler.requests)
            self.scheduler.mark_in_flight(scheduler_output)
            self.executor.submit_step(scheduler_output)
            self._in_flight.append(scheduler_output)
        outputs += self.scheduler.take_expired()
        if not self._in_flight:
            return self.make_outputs(outputs)
        scheduler_output = self._in_flight.popleft()
        try:
            runner_output = self.executor.take_step()
        except ExecutorDeadError:
            raise
        except Exception as exc:
            return self.make_outputs(outputs + self._fail_step(scheduler_output, exc))
        return self.make_outputs(outputs + self._update(scheduler_output, runner_output))

    def _update(self, scheduler_output: SchedulerOutput,
                runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.logprobs or runner_output.prompt_logprobs:
            _attach_logprobs(updated, runner_output)
        advanced = self.structured.advance(
            updated, lambda request_id, reason: self.scheduler.abort_requests([request_id],
                                                                             reason))
        self.propose_drafts(updated, runner_output)
        return advanced

    def _fail_step(self, scheduler_output: SchedulerOutput,
                   exc: Exception) -> list[EngineCoreOutput]:
        logger.exception("The model step failed; failing the requests in it.",
                         exc_info=exc)
        outputs = self.scheduler.fail_step(scheduler_output, f"model step failed: {exc!r}")
        self.structured.abort(list(scheduler_output.num_scheduled_tokens))
        return outputs

    def propose_drafts(self, updated: list[EngineCoreOutput],
                       runner_output: ModelRunnerOutput) -> None:
        """Speculative decoding: draft tokens for the next step of each request that got
        a token this step and may take them (verified, and released if rejected, there):
        the n-gram proposer's, or the draft model's that the worker proposed."""
        if self.speculative is None:
            return
        for output in updated:
            request = self.scheduler.requests.get(output.request_id)
            if (request is None or not request.can_speculate or output.finish_reason
                    or request.num_tokens_to_compute != 1):
                continue
            room = min(request.max_tokens - len(request.output_token_ids),
                       self.max_model_len - request.num_tokens) - 1
            if self.proposer is None:
                request.spec_token_ids = runner_output.draft_token_ids.get(
                    output.request_id, [])[:max(room, 0)]
            else:
                request.spec_token_ids = self.proposer.propose(
                    request.prompt_token_ids + request.output_token_ids, room)

    def make_outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """The batch to send: `outputs` with the scheduler's state and the stats since the
        last batch."""
        iteration_stats = self.scheduler.take_iteration_stats()
        if self.config.log_stats:
            grammar_compiles = self.structured.take_stats()
            if grammar_compiles:
                iteration_stats = iteration_stats or IterationStats(0, 0, [], [], [])
                iteration_stats.grammar_compiles = grammar_compiles
        return EngineCoreOutputs(outputs, time.time(), self.scheduler.make_stats(),
                                 iteration_stats)

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()

    def stats(self) -> Any:
        return self.scheduler.make_stats()


def _attach_logprobs(outputs: list[EngineCoreOutput], runner_output: ModelRunnerOutput
                     ) -> None:
    """Give each output the logprobs the worker computed for its new token (and prompt)."""
    for output in outputs:
        if not output.new_token_ids:
            continue
        entry = runner_output.logprobs.get(output.request_id)
        if entry is not None:
            output.new_logprobs = [entry]
        output.prompt_logprobs = runner_output.prompt_logprobs.get(output.request_id)


def _check_encoder_budget(config: EngineConfig, max_model_len: int) -> None:
    """An encoder reads each prompt whole in one step, so the step's token budget must hold
    the longest prompt."""
    budget = config.scheduler.max_num_batched_tokens
    if budget < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({budget}) is below the model's context "
                         f"length ({max_model_len}); an embedding model reads each prompt "
                         f"whole in one step, so raise it to at least {max_model_len}")


def kv_capacity_line(device_type: str, num_blocks: int, block_size: int,
                     max_model_len: int) -> str:
    """vLLM's start-up line: the KV cache's tokens, and how many requests of the model's
    full length it holds at once (each takes whole blocks)."""
    device = "GPU" if device_type == "cuda" else device_type.upper()
    blocks_per_request = -(-max_model_len // block_size)
    return (f"{device} KV cache size: {num_blocks * block_size:,} tokens, Maximum "
            f"concurrency for {max_model_len:,} tokens per request: "
            f"{num_blocks / blocks_per_request:.2f}x")
