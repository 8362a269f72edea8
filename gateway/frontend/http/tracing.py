"""OpenTelemetry traces of the API server (`--otlp-traces-endpoint`, vLLM's flag;
API-server process). Imported only when tracing is on, so a server without an endpoint
never imports the SDK. One SERVER span per HTTP request (`TracingMiddleware`), with vLLM's
`gen_ai.*` attributes added for a request that reaches the engine (`EngineSpans`); the
README's "Tracing" section lists them. Spans go out in batches over OTLP/HTTP (protobuf);
the standard `OTEL_*` variables apply. An endpoint that does not answer is said once in
the log (WARNING), and the server goes on serving.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import OrderedDict
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Receive, Scope, Send

import gateway
from gateway.frontend.http.route_owners import ResponseStatus, RouteOwners, ServingPlugins
from gateway.logger import init_logger
from gateway.messages import EngineCoreOutputs
from gateway.plugins import EngineClient

logger = init_logger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_MAX_OPEN_REQUESTS = 10_000  # engine request -> span, for requests whose stats are due
_EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                     "opentelemetry.exporter.otlp.proto.http", "opentelemetry.sdk.trace.export")


class _Once(logging.Filter):
    """Lets one record through per `interval_s`: an exporter that cannot reach its
    endpoint would otherwise log at every batch."""

    def __init__(self, interval_s: float = 600.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.last = -interval_s

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self.last < self.interval_s:
            return False
        self.last = now
        return True


def make_tracer_provider(endpoint: str) -> TracerProvider:
    """A provider that exports to `endpoint` (an OTLP/HTTP traces URL) in batches."""
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "gateway"),
                                "service.version": gateway.__version__})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint),
                                                   schedule_delay_millis=1000))
    once = _Once()
    for name in _EXPORTER_LOGGERS:
        logging.getLogger(name).addFilter(once)
    _warn_if_unreachable(endpoint)
    return provider


def _warn_if_unreachable(endpoint: str) -> None:
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "localhost", port), timeout=1.0):
            pass
    except OSError as exc:
        logger.warning("The OTLP traces endpoint %s does not answer (%s): the server serves "
                       "anyway, and spans are dropped until it does (said once).",
                       endpoint, exc)


class TracingMiddleware:
    """Raw ASGI: one SERVER span per HTTP request, named `METHOD ROUTE` (the route's path
    template), with `http.request.method`, `http.route`, `http.response.status_code`, the
    request id, and `gateway.plugin.name` on a plugin's route. A client's W3C `traceparent`
    makes it a child of the client's span.
    """

    def __init__(self, app: ASGIApp, tracer: trace.Tracer, plugins: ServingPlugins) -> None:
        self.app = app
        self.tracer = tracer
        self._owners = RouteOwners(plugins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        span = self.tracer.start_span(f"{scope['method']} {scope['path']}", kind=SpanKind.SERVER,
                                      context=_PROPAGATOR.extract(carrier),
                                      attributes={"http.request.method": scope["method"],
                                                  "url.path": scope["path"]})
        token = otel_context.attach(trace.set_span_in_context(span))
        status = ResponseStatus(send)
        try:
            await self.app(scope, receive, status)
        finally:
            self._finish(span, scope, status.code)
            otel_context.detach(token)

    def _finish(self, span: Any, scope: Scope, status: int) -> None:
        route, plugin = self._owners.route_and_plugin(scope)
        span.update_name(f"{scope['method']} {route}")
        span.set_attribute("http.route", route)
        span.set_attribute("http.response.status_code", status)
        request_id = (scope.get("state") or {}).get("request_id")
        if request_id:
            span.set_attribute("gateway.request_id", request_id)
        if plugin:
            span.set_attribute("gateway.plugin.name", plugin)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()


class EngineSpans:
    """Adds each engine request's `gen_ai.*` attributes to the HTTP span it runs under.

    `on_request` is the engine client's hook when a request is sent (the HTTP span is the
    current one then); `on_outputs` its outputs listener, where the finished requests'
    stats arrive."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._spans: OrderedDict[str, Any] = OrderedDict()

    def on_request(self, request_id: str, num_prompt_tokens: int, params: Any) -> None:
        span = trace.get_current_span()
        if not span.is_recording():
            return
        span.set_attribute("gen_ai.request.id", request_id)
        span.set_attribute("gen_ai.response.model", self.model_name)
        span.set_attribute("gen_ai.usage.prompt_tokens", num_prompt_tokens)
        for name in ("max_tokens", "temperature", "top_p", "n"):
            value = getattr(params, name, None)
            if isinstance(value, int | float) and not isinstance(value, bool):
                span.set_attribute(f"gen_ai.request.{name}", value)
        self._spans[request_id] = span
        while len(self._spans) > _MAX_OPEN_REQUESTS:
            self._spans.popitem(last=False)

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        stats = outputs.iteration_stats
        if stats is None:
            return
        for finished in stats.finished_requests:
            span = self._spans.pop(finished.request_id, None)
            if span is None or not span.is_recording():
                continue
            span.set_attributes({
                "gen_ai.usage.completion_tokens": finished.num_generation_tokens,
                "gen_ai.response.finish_reasons": [finished.finish_reason],
                "gen_ai.latency.time_in_queue": finished.queued_time,
                "gen_ai.latency.time_to_first_token": finished.queued_time + finished.prefill_time,
                "gen_ai.latency.time_in_model_prefill": finished.prefill_time,
                "gen_ai.latency.time_in_model_decode": finished.decode_time,
                "gen_ai.latency.time_in_model_inference": finished.inference_time,
                "gen_ai.latency.e2e": finished.e2e_latency,
            })


def attach_tracing(app: FastAPI, engine_client: EngineClient, endpoint: str,
                   plugins: ServingPlugins) -> TracerProvider:
    """Trace `app` and its engine requests to `endpoint`; returns the provider (shut it
    down at exit, which sends the last spans)."""
    provider = make_tracer_provider(endpoint)
    app.add_middleware(TracingMiddleware, tracer=provider.get_tracer("gateway"),
                       plugins=plugins)
    spans = EngineSpans(engine_client.model_name)
    engine_client.add_request_hook(spans.on_request)
    engine_client.add_outputs_listener(spans.on_outputs)
    logger.info("Tracing: spans go to %s (OTLP/HTTP).", endpoint)
    return provider
