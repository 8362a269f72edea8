"""Turning the engine cores' outputs into what each request's caller receives (front-end
process): `OutputProcessor` holds the requests in flight, each with the engine it went to,
and routes each batch of outputs to them (vLLM's OutputProcessor); `RequestState` is one
generation's detokenizer, stop strings and log-probabilities, and makes the `RequestOutput`
(gateway/outputs.py) its caller receives for each step."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from gateway.frontend.outputs.detokenizer import Decoder, IncrementalDetokenizer
from gateway.frontend.outputs.parallel_sampling import ParentRequests
from gateway.messages import EngineCoreOutput, EngineCoreOutputs, IterationStats, TokenLogprobs
from gateway.outputs import PoolingRequestOutput, RequestOutput
from gateway.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    #: When the request was sent to the engine (monotonic): its queue deadline counts from here.
    arrived_at: float = field(default_factory=time.monotonic)

    @classmethod
    def make(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             tokenizer: Decoder) -> RequestState:
        return cls(request_id, prompt_token_ids, params,
                   IncrementalDetokenizer(tokenizer, prompt_token_ids, params),
                   logprobs=[] if params.logprobs is not None else None)

    def process(self, output: EngineCoreOutput) -> RequestOutput:
        """Apply one engine output. A stop string found here finishes the request with
        finish_reason "stop" while the engine still runs it: the caller aborts it there."""
        self.token_ids.extend(output.new_token_ids)
        finish_reason: str | None = output.finish_reason
        stop_reason: str | int | None = output.stop_reason
        # EOS or a stop token: its text is not output, unless the client asked for it.
        skip_last = finish_reason == "stop" and not self.params.include_stop_str_in_output
        delta_logprobs = self._add_logprobs(output)
        stop_string = self.detokenizer.update(output.new_token_ids, skip_last=skip_last)
        new_token_ids = output.new_token_ids
        if stop_string is not None:
            finish_reason, stop_reason = "stop", stop_string
            new_token_ids = new_token_ids[:self.detokenizer.num_stop_tokens]
            del self.token_ids[len(self.token_ids) - len(output.new_token_ids)
                               + len(new_token_ids):]
        self.finished = finish_reason is not None
        delta_text = self.detokenizer.take_delta(self.finished)
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            text=self.detokenizer.output_text[:self.detokenizer.num_sent_chars],
            delta_text=delta_text,
            token_ids=list(self.token_ids), delta_token_ids=list(new_token_ids),
            finished=self.finished, finish_reason=finish_reason, stop_reason=stop_reason,
            error=output.error, error_kind=output.error_kind, error_param=output.error_param,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            delta_logprobs=delta_logprobs, prompt_logprobs=self.prompt_logprobs)

    def _add_logprobs(self, output: EngineCoreOutput) -> list[TokenLogprobs] | None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None \
                and output.new_token_ids:
            # The first token has none; so has any prompt token whose KV the engine
            # found cached and did not compute (the entries are the prompt's tail).
            entries = output.prompt_logprobs or []
            missing = len(self.prompt_token_ids) - len(entries)
            self.prompt_logprobs = [None] * missing + list(entries)
        if self.logprobs is None:
            return None
        delta = list(output.new_logprobs or [])
        self.logprobs += delta
        return delta


@dataclass
class PoolingState:
    prompt_token_ids: list[int]
    future: asyncio.Future[PoolingRequestOutput]
    arrived_at: float = field(default_factory=time.monotonic)


@dataclass
class ProcessedOutputs:
    """What one batch of outputs asks of the engine client."""

    num_finished: int = 0
    #: Requests a stop string ended here while the engine still runs them: abort them there.
    stopped: list[str] = field(default_factory=list)
    #: (request id, reason) of each request the engine refused by its queue deadline.
    refused: list[tuple[str, str]] = field(default_factory=list)


class OutputProcessor:
    """The requests in flight in this front end, by id, with the engine each was sent to,
    and what each batch of engine outputs does to them: a generation's next `RequestOutput`
    on its stream, a pooling's result on its future."""

    def __init__(self, tokenizer: Decoder, num_engines: int, count_stops: bool) -> None:
        self.tokenizer = tokenizer
        self.generations: dict[str, RequestState] = {}
        self.poolings: dict[str, PoolingState] = {}
        #: The choices of each request with n > 1 (for `vllm:request_params_n`).
        self.parent_requests = ParentRequests()
        self._engine_of: dict[str, int] = {}
        self._num_requests = [0] * num_engines
        # Requests a stop string ended here whose end the engine has not yet counted: the
        # engine may reach max_tokens before the abort arrives, and count it as "length".
        self._stopped_here: set[str] = set()
        self._count_stops = count_stops

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._engine_of

    def __len__(self) -> int:
        return len(self.generations) + len(self.poolings)

    def num_requests(self, engine: int) -> int:
        """The requests in flight on engine `engine`."""
        return self._num_requests[engine]

    def engine_of(self, request_id: str) -> int | None:
        return self._engine_of.get(request_id)

    def arrived_since(self, engine: int, since: float
                      ) -> Iterator[tuple[str, float, float | None]]:
        """(request id, arrival, its own max_queue_time) of each request on engine `engine`
        that arrived after `since` (monotonic) and is still waiting for its answer."""
        for request_id, state in self.generations.items():
            if (not state.finished and state.arrived_at > since
                    and self._engine_of.get(request_id) == engine):
                yield request_id, state.arrived_at, state.params.max_queue_time
        for request_id, pooling in self.poolings.items():
            if pooling.arrived_at > since and self._engine_of.get(request_id) == engine:
                yield request_id, pooling.arrived_at, None

    # ------------------------------------------------------------------ in and out
    def add_generation(self, state: RequestState, engine: int) -> None:
        self.generations[state.request_id] = state
        self._track(state.request_id, engine)

    def add_pooling(self, request_id: str, prompt_token_ids: list[int], engine: int
                    ) -> asyncio.Future[PoolingRequestOutput]:
        future: asyncio.Future[PoolingRequestOutput] = \
            asyncio.get_running_loop().create_future()
        self.poolings[request_id] = PoolingState(prompt_token_ids, future)
        self._track(request_id, engine)
        return future

    def end_generation(self, request_id: str) -> RequestState | None:
        """Forget a generation (None when it was no longer in flight)."""
        state = self.generations.pop(request_id, None)
        if state is not None:
            self._untrack(request_id)
        return state

    def end_pooling(self, request_id: str) -> PoolingState | None:
        pooling = self.poolings.pop(request_id, None)
        if pooling is not None:
            self._untrack(request_id)
        return pooling

    # ------------------------------------------------------------------ outputs
    def process(self, outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """Route one batch of an engine's outputs to their requests."""
        processed = ProcessedOutputs()
        for output in outputs.outputs:
            processed.num_finished += output.finish_reason is not None
            if output.error_kind == "queue_timeout":
                processed.refused.append((output.request_id, output.error or "queue timeout"))
                continue
            pooling = self.end_pooling(output.request_id)
            if pooling is not None:
                if not pooling.future.done():
                    pooling.future.set_result(
                        PoolingRequestOutput.from_engine(output, pooling.prompt_token_ids))
                continue
            if self._generated(output):
                processed.stopped.append(output.request_id)
        if outputs.iteration_stats is not None:
            self._count_iteration(outputs.iteration_stats)
        return processed

    def _generated(self, output: EngineCoreOutput) -> bool:
        """Put a generation's next output on its stream; True when a stop string ended it
        here while the engine still runs it."""
        state = self.generations.get(output.request_id)
        if state is None or state.finished:
            return False
        result = state.process(output)
        state.queue.put_nowait(result)
        if not (result.finished and result.finish_reason == "stop"
                and output.finish_reason != "stop"):
            return False
        # A stop string ended it: the engine stops it, counted as a "stop".
        if self._count_stops:
            self._stopped_here.add(output.request_id)
        return output.finish_reason is None

    def _count_iteration(self, stats: IterationStats) -> None:
        """What only this front end knows of the finished requests: a stop string ended
        them, and which ones were the choices of one request (`vllm:request_params_n`)."""
        if self._stopped_here:
            for finished in stats.finished_requests:
                if finished.request_id in self._stopped_here:
                    self._stopped_here.discard(finished.request_id)
                    finished.finish_reason = "stop"  # what the client was sent
        stats.n_params_iter = self.parent_requests.n_params(stats.finished_requests)

    def refuse(self, request_id: str, error: BaseException) -> None:
        """End a request the engine refused (it has dropped it: no abort to send)."""
        pooling = self.end_pooling(request_id)
        if pooling is not None and not pooling.future.done():
            pooling.future.set_exception(error)
        state = self.generations.get(request_id)
        if state is not None and not state.finished:
            state.finished = True
            state.queue.put_nowait(error)

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error` (their callers raise it)."""
        for pooling in self.poolings.values():
            if not pooling.future.done():
                pooling.future.set_exception(error)
        for state in list(self.generations.values()):
            if not state.finished:
                state.finished = True
                state.queue.put_nowait(error)

    def _track(self, request_id: str, engine: int) -> None:
        self._engine_of[request_id] = engine
        self._num_requests[engine] += 1

    def _untrack(self, request_id: str) -> None:
        engine = self._engine_of.pop(request_id, None)
        if engine is not None:
            self._num_requests[engine] -= 1
