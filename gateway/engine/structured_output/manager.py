"""Structured outputs in the engine-core process: grammars compiled off the step loop, one
matcher per request, the step's token bitmask, and the matchers advanced with each
sampled token.

A constrained request waits here, outside the scheduler, until its grammar is compiled
(in a thread pool, after a trial compile in a helper process with a time and memory
limit; a cached grammar is ready at once), while other requests keep running. A grammar
that does not compile answers its request with a 400 naming the field before it is ever
scheduled. How compilation is bounded and cached: docs/structured-outputs.md.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway import envs
from gateway.config import ModelConfig, StructuredOutputsConfig
from gateway.engine.request import Request
from gateway.helper_process import HelperJobError, HelperLimitError, HelperPool
from gateway.logger import init_logger
from gateway.messages import EngineCoreOutput, GrammarCompileStats, SchedulerOutput
from gateway.structured_outputs_params import SLOW_GRAMMAR_COMPILE_S

logger = init_logger(__name__)

_COMPILE_WORKERS = 2  # threads in this process, and trial helpers: one slow grammar of two
_MIB = 1024 * 1024
#: The built-in JSON grammar is fixed and cheap: it needs no trial.
_TRUSTED_KINDS = ("json_object",)

GrammarKey = tuple[str, str, bool]


class GrammarLimitError(Exception):
    """A grammar refused because compiling it passed a limit (time or memory)."""


@dataclass
class _Compile:
    """One grammar being compiled, and the requests waiting for it."""

    future: cf.Future[Any]
    cancelled: threading.Event
    waiting: set[str] = field(default_factory=set)


class GrammarCache:
    """Compiled grammars by key, least recently used first out, up to `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self._entries: collections.OrderedDict[GrammarKey, tuple[Any, int]] = \
            collections.OrderedDict()

    def get(self, key: GrammarKey) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: GrammarKey, compiled: Any, num_bytes: int) -> None:
        if key in self._entries or num_bytes > self.budget_bytes:
            return  # a grammar larger than the whole cache serves its own requests only
        self._entries[key] = (compiled, num_bytes)
        self.num_bytes += num_bytes
        while self.num_bytes > self.budget_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.num_bytes -= evicted

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: GrammarKey) -> bool:
        return key in self._entries


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig, vocab_size: int,
                 stop_token_ids: list[int],
                 config: StructuredOutputsConfig | None = None) -> None:
        self._model_config = model_config
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._config = config or StructuredOutputsConfig()
        self._budget_bytes = envs.xgrammar_cache_mb() * _MIB
        self._pool: cf.ThreadPoolExecutor | None = None
        self._trials: HelperPool | None = None
        self._backend: cf.Future[Any] | None = None
        self.grammars = GrammarCache(self._budget_bytes)
        self._compiling: dict[GrammarKey, _Compile] = {}
        self._waiting: dict[str, tuple[Request, GrammarKey, cf.Future[Any]]] = {}
        self._matchers: dict[str, Any] = {}
        self._stats: collections.deque[GrammarCompileStats] = collections.deque()

    # ------------------------------------------------------------------ requests in
    def add_request(self, request: Request) -> None:
        """Hold a constrained request until its grammar is compiled."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = params.cache_key
        self._waiting[request.request_id] = (request, key, self._compiled(key, request))

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def take_ready(self, admit: Callable[[Request], None],
                   wait_s: float = 0.0) -> list[EngineCoreOutput]:
        """Pass each request whose grammar is ready to `admit` (the scheduler), with its
        matcher made; answer those whose grammar failed. With `wait_s`, wait that long for
        a compilation to end when none has (the engine has nothing else to do)."""
        futures = [future for _, _, future in self._waiting.values()]
        if wait_s and not any(future.done() for future in futures):
            cf.wait(futures, timeout=wait_s, return_when=cf.FIRST_COMPLETED)
        self._keep_compiled()
        errors = []
        for request_id, (request, _, future) in list(self._waiting.items()):
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
        """Forget the requests; stop a compilation none of the others waits for."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            waiting = self._waiting.pop(request_id, None)
            if waiting is None:
                continue
            compile_ = self._compiling.get(waiting[1])
            if compile_ is None:
                continue
            compile_.waiting.discard(request_id)
            if not compile_.waiting:
                compile_.cancelled.set()
                compile_.future.cancel()
                del self._compiling[waiting[1]]  # its result, if it comes, is not kept

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

    def take_stats(self) -> list[GrammarCompileStats]:
        """The compilations that ended since the last call."""
        stats = []
        while self._stats:
            stats.append(self._stats.popleft())
        return stats

    # ------------------------------------------------------------------ grammars
    @property
    def backend(self) -> Any:
        """The grammar backend, built in the pool at the first constrained request (the
        tokenizer's vocabulary is read only if structured outputs are used)."""
        return self._backend_future().result()

    def _backend_future(self) -> cf.Future[Any]:
        if self._backend is None:
            self._backend = self._executor().submit(self._make_backend)
        return self._backend

    def _compiled(self, key: GrammarKey, request: Request) -> cf.Future[Any]:
        """A future of the compiled grammar: done at once when cached, shared while the
        same grammar compiles for another request."""
        cached = self.grammars.get(key)
        if cached is not None:
            done: cf.Future[Any] = cf.Future()
            done.set_result(cached)
            return done
        compile_ = self._compiling.get(key)
        if compile_ is None:
            cancelled = threading.Event()
            backend = self._backend_future()
            param = request.sampling_params.structured_outputs
            label = f"request {request.request_id} ({getattr(param, 'source_param', '?')})"
            future = self._executor().submit(self._compile, key, backend, cancelled, label)
            compile_ = self._compiling[key] = _Compile(future, cancelled)
        compile_.waiting.add(request.request_id)
        return compile_.future

    def _keep_compiled(self) -> None:
        """Move grammars compiled for requests still waiting into the cache."""
        for key, compile_ in list(self._compiling.items()):
            if not compile_.future.done():
                continue
            del self._compiling[key]
            if compile_.future.cancelled() or compile_.future.exception() is not None:
                continue
            compiled = compile_.future.result()
            self.grammars.put(key, compiled, int(compiled.memory_size_bytes))

    def _compile(self, key: GrammarKey, backend_future: cf.Future[Any],
                 cancelled: threading.Event, label: str) -> Any:
        """In a compile thread: the trial in a helper, then the compile here. The time
        reported is the trial's and this compile's (not the wait for a free helper)."""
        from gateway.engine.structured_output.xgrammar_backend import GrammarSpecError

        backend = backend_future.result()
        outcome, seconds = "error", 0.0
        try:
            if self._trials is not None and key[0] not in _TRUSTED_KINDS:
                seconds = self._trial(key, cancelled)
            if cancelled.is_set():
                raise HelperLimitError("cancelled", "no request waits for it")
            started = time.monotonic()
            compiled = backend.compile(*key)
            seconds += time.monotonic() - started
            outcome = "compiled"
            return compiled
        except GrammarSpecError:
            outcome = "invalid"
            raise
        except HelperLimitError as exc:
            outcome = "timeout" if exc.limit == "time" else exc.limit
            seconds = exc.seconds
            raise self._limit_error(exc, label) from None
        finally:
            if outcome != "cancelled":
                self._stats.append(GrammarCompileStats(seconds, outcome))
            if outcome == "compiled" and seconds > SLOW_GRAMMAR_COMPILE_S:
                logger.warning("Slow grammar: %s took %.2f s to compile (%s, %d characters).",
                               label, seconds, key[0], len(key[1]))

    def _trial(self, key: GrammarKey, cancelled: threading.Event) -> float:
        """The trial's compile time; its errors as this process's compile would raise."""
        from gateway.engine.structured_output.xgrammar_backend import GrammarSpecError

        assert self._trials is not None
        try:
            _, seconds = self._trials.run(list(key), self._config.compile_timeout_s,
                                          cancelled)
        except HelperJobError as exc:
            if exc.kind == GrammarSpecError.__name__:
                raise GrammarSpecError(str(exc)) from None
            raise RuntimeError(f"the grammar compiler failed: {exc.kind}: {exc}") from None
        return float(seconds)

    def _limit_error(self, exc: HelperLimitError, label: str) -> Exception:
        if exc.limit == "cancelled":
            return cf.CancelledError()
        if exc.limit == "time":
            logger.warning("Grammar refused: %s was still compiling after %.1f s, over the "
                           "limit of %g s; its compilation was stopped.", label, exc.seconds,
                           self._config.compile_timeout_s)
            return GrammarLimitError(
                f"compiling this constraint took more than {self._config.compile_timeout_s:g} "
                "s, this server's limit (--structured-outputs-compile-timeout); simplify it")
        logger.warning("Grammar refused: %s needed more than %d MiB to compile; its "
                       "compilation was stopped.", label, self._budget_bytes // _MIB)
        return GrammarLimitError(
            f"compiling this constraint needed more than {self._budget_bytes // _MIB} MiB, "
            "this server's limit (VLLM_XGRAMMAR_CACHE_MB); simplify it")

    def _make_backend(self) -> Any:
        from gateway.engine.structured_output.xgrammar_backend import XgrammarBackend
        from gateway.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self._model_config.model)
        backend = XgrammarBackend.for_tokenizer(tokenizer, self._vocab_size,
                                                self._stop_token_ids)
        if self._config.compile_timeout_s is not None:
            self._trials = HelperPool(
                "gateway.engine.structured_output.trial_compile",
                backend.info.serialize_json(), size=_COMPILE_WORKERS,
                memory_bytes=self._budget_bytes, name="grammar-trial",
                preload=["gateway.engine.structured_output.xgrammar_backend"])
            self._trials.start()  # in the background, while the first grammar waits
        return backend

    def _executor(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="grammar")
        return self._pool

    def shutdown(self) -> None:
        for compile_ in self._compiling.values():
            compile_.cancelled.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._trials is not None:
            self._trials.close()


def _samples(request: Request, num_scheduled: int) -> bool:
    """Whether the request reaches the end of its known tokens this step (so it samples);
    a chunk in the middle of a long prompt does not."""
    return request.num_computed_tokens + num_scheduled >= request.num_tokens


def _invalid(request: Request, exc: BaseException) -> EngineCoreOutput:
    from gateway.engine.structured_output.xgrammar_backend import GrammarSpecError

    params = request.sampling_params.structured_outputs
    param = params.source_param if params is not None else "structured_outputs"
    if not isinstance(exc, (GrammarSpecError, GrammarLimitError)):
        logger.exception("Structured outputs failed for request %s", request.request_id,
                         exc_info=exc)
        return EngineCoreOutput(request.request_id, [], "error", error=f"structured "
                                f"outputs failed: {exc}", error_kind="internal")
    return EngineCoreOutput(request.request_id, [], "error", error=f"Invalid {param}: {exc}",
                            error_kind="invalid_request", error_param=param)
