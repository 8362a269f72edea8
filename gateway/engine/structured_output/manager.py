"""Structured outputs in the engine core: grammars compiled off the step loop, one matcher
per request, the step's token bitmask, and the matchers advanced with each sampled token.

A constrained request waits here, outside the scheduler, until its grammar is compiled
(in a thread pool; a cached grammar is ready at once): other requests keep running
meanwhile. A grammar that does not compile answers the request with a 400 naming the
field it came from, before the request is ever scheduled.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gateway.config import ModelConfig
from gateway.engine.request import Request
from gateway.logger import init_logger
from gateway.messages import EngineCoreOutput, SchedulerOutput

logger = init_logger(__name__)

_MAX_CACHED_GRAMMARS = 256
_COMPILE_WORKERS = 2


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig, vocab_size: int,
                 stop_token_ids: list[int]) -> None:
        self._model_config = model_config
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._pool: cf.ThreadPoolExecutor | None = None
        self._backend: cf.Future[Any] | None = None
        self._grammars: OrderedDict[tuple[str, str, bool], cf.Future[Any]] = OrderedDict()
        self._waiting: dict[str, tuple[Request, cf.Future[Any]]] = {}
        self._matchers: dict[str, Any] = {}

    # ------------------------------------------------------------------ requests in
    def add_request(self, request: Request) -> None:
        """Hold a constrained request until its grammar is compiled."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        self._waiting[request.request_id] = (request, self._compiled(params.cache_key))

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def take_ready(self, admit: Callable[[Request], None],
                   wait_s: float = 0.0) -> list[EngineCoreOutput]:
        """Pass each request whose grammar is ready to `admit` (the scheduler), with its
        matcher made; answer those whose grammar failed. With `wait_s`, wait that long for
        a compilation to end when none has (the engine has nothing else to do)."""
        if wait_s and not any(future.done() for _, future in self._waiting.values()):
            cf.wait([future for _, future in self._waiting.values()], timeout=wait_s,
                    return_when=cf.FIRST_COMPLETED)
        errors = []
        for request_id, (request, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[request_id]
            try:
                self._matchers[request_id] = self.backend.matcher(future.result())
            except Exception as exc:  # the spec was invalid (or the backend failed to load)
                errors.append(_invalid(request, exc))
                continue
            admit(request)
        return errors

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._waiting.pop(request_id, None)
            self._matchers.pop(request_id, None)

    # ------------------------------------------------------------------ one step
    def attach_bitmask(self, scheduler_output: SchedulerOutput,
                       requests: dict[str, Request]) -> None:
        """Fill the bitmask rows of the constrained requests that sample this step."""
        req_ids = [rid for rid, num_tokens in scheduler_output.num_scheduled_tokens.items()
                   if rid in self._matchers
                   and _samples(requests[rid], num_tokens)]
        if not req_ids:
            return
        bitmask = self.backend.allocate_bitmask(len(req_ids))
        for row, request_id in enumerate(req_ids):
            self._matchers[request_id].fill_next_token_bitmask(bitmask, row)
        scheduler_output.grammar_req_ids = req_ids
        scheduler_output.grammar_bitmask = bitmask.tobytes()

    def advance(self, outputs: list[EngineCoreOutput],
                finish: Callable[[str, str], object]) -> list[EngineCoreOutput]:
        """Feed each constrained request's new token to its matcher. A request whose
        grammar has reached its end finishes with `stop` (`finish(request_id, reason)`);
        one whose token the grammar refuses fails. Matchers of finished requests go."""
        failed = []
        for output in outputs:
            matcher = self._matchers.get(output.request_id)
            if matcher is None:
                continue
            for token_id in output.new_token_ids:
                if not matcher.accept_token(token_id):
                    output.finish_reason, output.error = "error", (
                        f"the sampled token {token_id} does not follow the request's grammar")
                    output.error_kind = "internal"
                    failed.append(output.request_id)
                    break
            if output.finish_reason is None and matcher.is_terminated():
                output.finish_reason = "stop"
                finish(output.request_id, "stop")
            if output.finish_reason is not None:
                del self._matchers[output.request_id]
        for request_id in failed:
            finish(request_id, "error")
        return outputs

    # ------------------------------------------------------------------ grammars
    @property
    def backend(self) -> Any:
        """The grammar backend, built in the pool at the first constrained request (the
        tokenizer's vocabulary is read only if structured outputs are used)."""
        if self._backend is None:
            self._backend = self._executor().submit(self._make_backend)
        return self._backend.result()

    def _compiled(self, key: tuple[str, str, bool]) -> cf.Future[Any]:
        future = self._grammars.get(key)
        if future is not None:
            self._grammars.move_to_end(key)
            return future
        if self._backend is None:
            self._backend = self._executor().submit(self._make_backend)
        backend_future = self._backend
        future = self._executor().submit(lambda: backend_future.result().compile(*key))
        self._grammars[key] = future
        if len(self._grammars) > _MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return future

    def _make_backend(self) -> Any:
        from gateway.engine.structured_output.xgrammar_backend import XgrammarBackend
        from gateway.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self._model_config.model)
        return XgrammarBackend(tokenizer, self._vocab_size, self._stop_token_ids)

    def _executor(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="grammar")
        return self._pool

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _samples(request: Request, num_scheduled: int) -> bool:
    """Whether the request reaches the end of its known tokens this step (so it samples);
    a chunk in the middle of a long prompt does not."""
    return request.num_computed_tokens + num_scheduled >= request.num_tokens


def _invalid(request: Request, exc: Exception) -> EngineCoreOutput:
    from gateway.engine.structured_output.xgrammar_backend import GrammarSpecError

    params = request.sampling_params.structured_outputs
    param = params.source_param if params is not None else "structured_outputs"
    if not isinstance(exc, GrammarSpecError):
        logger.exception("Structured outputs failed for request %s", request.request_id,
                         exc_info=exc)
        return EngineCoreOutput(request.request_id, [], "error", error=f"structured "
                                f"outputs failed: {exc}", error_kind="internal")
    return EngineCoreOutput(request.request_id, [], "error", error=f"Invalid {param}: {exc}",
                            error_kind="invalid_request", error_param=param)
