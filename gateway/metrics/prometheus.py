"""The built-in Prometheus stat logger: vLLM's metric names, types and labels.

Front-end process. The names are vLLM's (`vllm:` and all) wherever the meaning is the same,
so dashboards and autoscalers written for vLLM work unchanged; every series carries
`model_name` and `engine`. The metrics are one table (`engine_metrics`), declared by one
loop in the app's registry (never the global one).
"""

from __future__ import annotations

from typing import Any

from gateway.messages import IterationStats, SchedulerStats
from gateway.metrics.registry import MetricSpec, MetricsRegistries
from gateway.plugins import StatLoggerBase
from gateway.structured_outputs_params import SLOW_GRAMMAR_COMPILE_S

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets, with two finer ones below 10 ms for small models on fast hardware.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)  # vLLM's, for `vllm:request_params_n`
GRAMMAR_OUTCOMES = ("compiled", "invalid", "timeout", "memory", "error")
GRAMMAR_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)
REQUEST_TIME_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                        20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                        7680.0)


def token_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's build_1_2_5_buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


def iteration_buckets(max_num_batched_tokens: int) -> tuple[float, ...]:
    """1, 8, 16, 32, ... up to the step's token budget (vLLM's iteration-token buckets)."""
    buckets, size = [1.0], 8
    while size <= max_num_batched_tokens:
        buckets.append(float(size))
        size *= 2
    return tuple(buckets)


def engine_metrics(max_model_len: int, max_num_batched_tokens: int = 2048,
                   ) -> tuple[MetricSpec, ...]:
    """Every metric of the engine, by vLLM's exposed name."""
    tokens = token_buckets(max_model_len)
    return (
        MetricSpec("vllm:num_requests_running", "gauge",
                   "Number of requests in model execution batches."),
        MetricSpec("vllm:num_requests_waiting", "gauge",
                   "Number of requests waiting to be processed."),
        MetricSpec("vllm:kv_cache_usage_perc", "gauge",
                   "KV-cache usage. 1 means 100 percent usage."),
        MetricSpec("vllm:num_preemptions_total", "counter",
                   "Cumulative number of preemptions from the engine."),
        MetricSpec("vllm:prefix_cache_queries", "counter",
                   "Prefix cache queries, in terms of number of queried tokens."),
        MetricSpec("vllm:prefix_cache_hits", "counter",
                   "Prefix cache hits, in terms of number of cached tokens."),
        MetricSpec("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed."),
        MetricSpec("vllm:generation_tokens_total", "counter",
                   "Number of generation tokens processed."),
        MetricSpec("vllm:request_success_total", "counter",
                   "Count of finished requests, by finish reason.", labels=("finished_reason",)),
        MetricSpec("vllm:time_to_first_token_seconds", "histogram",
                   "Histogram of time to first token in seconds.", TTFT_BUCKETS),
        MetricSpec("vllm:inter_token_latency_seconds", "histogram",
                   "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
        # vLLM's older name of the same values, still read by many dashboards.
        MetricSpec("vllm:time_per_output_token_seconds", "histogram",
                   "Histogram of time per output token in seconds.", ITL_BUCKETS),
        MetricSpec("vllm:iteration_tokens_total", "histogram",
                   "Histogram of number of tokens per engine_step.",
                   iteration_buckets(max_num_batched_tokens)),
        MetricSpec("vllm:e2e_request_latency_seconds", "histogram",
                   "Histogram of e2e request latency in seconds.", REQUEST_TIME_BUCKETS),
        MetricSpec("vllm:request_queue_time_seconds", "histogram",
                   "Histogram of time spent in WAITING phase for request.",
                   REQUEST_TIME_BUCKETS),
        MetricSpec("vllm:request_inference_time_seconds", "histogram",
                   "Histogram of time spent in RUNNING phase for request.",
                   REQUEST_TIME_BUCKETS),
        MetricSpec("vllm:request_prefill_time_seconds", "histogram",
                   "Histogram of time spent in PREFILL phase for request.",
                   REQUEST_TIME_BUCKETS),
        MetricSpec("vllm:request_decode_time_seconds", "histogram",
                   "Histogram of time spent in DECODE phase for request.",
                   REQUEST_TIME_BUCKETS),
        MetricSpec("vllm:request_prompt_tokens", "histogram",
                   "Number of prefill tokens processed.", tokens),
        MetricSpec("vllm:request_generation_tokens", "histogram",
                   "Number of generation tokens processed.", tokens),
        MetricSpec("vllm:request_params_max_tokens", "histogram",
                   "Histogram of the max_tokens request parameter.", tokens),
        MetricSpec("vllm:request_params_n", "histogram",
                   "Histogram of the n request parameter.", N_BUCKETS),
        # vLLM's info gauge of LoRA adapters: the time of the latest stats, labelled with
        # the adapters running and waiting (comma-separated names) and --max-loras.
        MetricSpec("vllm:lora_requests_info", "gauge", "Running stats on lora requests.",
                   labels=("max_lora", "waiting_lora_adapters", "running_lora_adapters")),
        # The gateway's own: structured outputs' grammars, compiled or stopped.
        MetricSpec("gateway_grammar_compile_seconds", "histogram",
                   "Time each grammar compilation took, stopped ones included.",
                   GRAMMAR_BUCKETS),
        MetricSpec("gateway_grammar_compiles_total", "counter",
                   "Grammar compilations that ended, by outcome (compiled, invalid, timeout, "
                   "memory, error).", labels=("outcome",)),
        MetricSpec("gateway_grammar_slow_compiles_total", "counter",
                   f"Grammar compilations longer than {SLOW_GRAMMAR_COMPILE_S:g} s, stopped "
                   "ones included."),
    )


def spec_decode_metrics() -> tuple[MetricSpec, ...]:
    """vLLM's speculative-decoding counters, declared when --speculative-config is set."""
    return (
        MetricSpec("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts."),
        MetricSpec("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens."),
        MetricSpec("vllm:spec_decode_num_accepted_tokens", "counter",
                   "Number of accepted tokens."),
        MetricSpec("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
                   "Accepted tokens per draft position.", labels=("position",)),
    )


_BY_LABEL = ("vllm:request_success_total", "gateway_grammar_compiles_total",
             "vllm:lora_requests_info", "vllm:spec_decode_num_accepted_tokens_per_pos")
# Per finished request: histogram -> the FinishedRequestStats field it observes.
_FINISHED_HISTOGRAMS = (
    ("vllm:e2e_request_latency_seconds", "e2e_latency"),
    ("vllm:request_queue_time_seconds", "queued_time"),
    ("vllm:request_inference_time_seconds", "inference_time"),
    ("vllm:request_prefill_time_seconds", "prefill_time"),
    ("vllm:request_decode_time_seconds", "decode_time"),
    ("vllm:request_prompt_tokens", "num_prompt_tokens"),
    ("vllm:request_generation_tokens", "num_generation_tokens"),
)


class PrometheusStatLogger(StatLoggerBase):
    """Sets vLLM's metrics from each step's stats. Built in; made by the StatLoggerManager
    with the app's registries (the one thing a plugin's constructor cannot carry)."""

    def __init__(self, config: Any, engine_index: int = 0, *,
                 registries: MetricsRegistries) -> None:
        super().__init__(config, engine_index)
        model = config.model
        max_model_len = model.max_model_len or 4096
        budget = getattr(getattr(config, "scheduler", None), "max_num_batched_tokens", 2048)
        speculative = getattr(config, "speculative", None)
        metrics = registries.declare(engine_metrics(max_model_len, budget) + (
            spec_decode_metrics() if speculative is not None else ()), LABELS)
        labels = (str(model.served_model_name or model.model), str(engine_index))
        child = {name: m.labels(*labels) for name, m in metrics.items()
                 if name not in _BY_LABEL}
        self._running = child["vllm:num_requests_running"]
        self._waiting = child["vllm:num_requests_waiting"]
        self._kv_usage = child["vllm:kv_cache_usage_perc"]
        self._preemptions = child["vllm:num_preemptions_total"]
        self._prefix_queries = child["vllm:prefix_cache_queries"]
        self._prefix_hits = child["vllm:prefix_cache_hits"]
        self._prompt_tokens = child["vllm:prompt_tokens_total"]
        self._generation_tokens = child["vllm:generation_tokens_total"]
        self._ttft = child["vllm:time_to_first_token_seconds"]
        self._itl = child["vllm:inter_token_latency_seconds"]
        self._tpot = child["vllm:time_per_output_token_seconds"]
        self._iteration_tokens = child["vllm:iteration_tokens_total"]
        self._max_tokens = child["vllm:request_params_max_tokens"]
        self._n = child["vllm:request_params_n"]
        self._finished = [(child[name], field) for name, field in _FINISHED_HISTOGRAMS]
        success = metrics["vllm:request_success_total"]
        self._labels = labels
        self._success_metric = success
        # Made up front, so every reason is a series (at 0) from the first scrape.
        self._success = {reason: success.labels(*labels, reason) for reason in FINISH_REASONS}
        compiles = metrics["gateway_grammar_compiles_total"]
        self._grammar_outcomes = {outcome: compiles.labels(*labels, outcome)
                                  for outcome in GRAMMAR_OUTCOMES}
        self._grammar_seconds = child["gateway_grammar_compile_seconds"]
        self._grammar_slow = child["gateway_grammar_slow_compiles_total"]
        lora = getattr(config, "lora", None)
        self._max_lora = None if lora is None else str(lora.max_loras)
        self._lora_metric = metrics["vllm:lora_requests_info"]
        self._lora_labels: tuple[str, ...] | None = None
        self._spec: tuple[Any, Any, Any, list[Any]] | None = None
        if speculative is not None:
            per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
            self._spec = (child["vllm:spec_decode_num_drafts"],
                          child["vllm:spec_decode_num_draft_tokens"],
                          child["vllm:spec_decode_num_accepted_tokens"],
                          [per_pos.labels(*labels, str(position))
                           for position in range(speculative.num_speculative_tokens)])

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self._running.set(scheduler_stats.num_running_reqs)
            self._waiting.set(scheduler_stats.num_waiting_reqs)
            self._kv_usage.set(scheduler_stats.kv_cache_usage)
            if scheduler_stats.num_preemptions:
                self._preemptions.inc(scheduler_stats.num_preemptions)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None and prefix.queries:
                self._prefix_queries.inc(prefix.queries)
                self._prefix_hits.inc(prefix.hits)
            if self._max_lora is not None:
                self._record_loras(scheduler_stats)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)

    def _record_iteration(self, stats: IterationStats) -> None:
        if stats.num_prompt_tokens:
            self._prompt_tokens.inc(stats.num_prompt_tokens)
        self._generation_tokens.inc(stats.num_generation_tokens)
        num_step_tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        if num_step_tokens:
            self._iteration_tokens.observe(num_step_tokens)
        for ttft in stats.time_to_first_tokens_iter:
            self._ttft.observe(ttft)
        observe_itl = self._itl.observe  # one per running request per step: the hot loop
        observe_tpot = self._tpot.observe
        for itl in stats.inter_token_latencies_iter:
            observe_itl(itl)
            observe_tpot(itl)
        for request in stats.finished_requests:
            self._success_for(request.finish_reason).inc()
            for histogram, field in self._finished:
                histogram.observe(getattr(request, field))
            if request.max_tokens_param is not None:
                self._max_tokens.observe(request.max_tokens_param)
        for n in stats.n_params_iter:
            self._n.observe(n)
        for compile_ in stats.grammar_compiles:
            self._grammar_seconds.observe(compile_.seconds)
            outcome = self._grammar_outcomes.get(compile_.outcome)
            if outcome is not None:
                outcome.inc()
            if compile_.seconds > SLOW_GRAMMAR_COMPILE_S:
                self._grammar_slow.inc()
        spec = stats.spec_decoding_stats
        if spec is not None and self._spec is not None:
            drafts, draft_tokens, accepted, per_pos = self._spec
            drafts.inc(spec.num_drafts)
            draft_tokens.inc(spec.num_draft_tokens)
            accepted.inc(spec.num_accepted_tokens)
            for counter, count in zip(per_pos, spec.num_accepted_tokens_per_pos):
                counter.inc(count)

    def _record_loras(self, stats: SchedulerStats) -> None:
        """One series: the latest adapters (an earlier set of labels is removed)."""
        assert self._max_lora is not None
        labels = (*self._labels, self._max_lora, ",".join(sorted(stats.waiting_lora_adapters)),
                  ",".join(sorted(stats.running_lora_adapters)))
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self._lora_metric.remove(*self._lora_labels)
            self._lora_labels = labels
        self._lora_metric.labels(*labels).set_to_current_time()

    def _success_for(self, reason: str) -> Any:
        counter = self._success.get(reason)
        if counter is None:
            counter = self._success[reason] = self._success_metric.labels(*self._labels, reason)
        return counter

    def log_engine_initialized(self) -> None:
        """Nothing to print: the metrics are scraped."""
