"""OpenTelemetry traces through a real OTLP/HTTP receiver: one span per request with the
client's trace as parent, the engine's gen_ai timings, a plugin route's span naming its
plugin; an endpoint that does not answer is said once; no endpoint, no SDK import."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.frontend.fake_endpoints import write_fake_endpoints
from tests.server import free_port

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint on loopback that decodes what it receives."""

    def __init__(self) -> None:
        self.spans: list = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, predicate, timeout_s: float = 30.0) -> list:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [span for span in list(self.spans) if predicate(span)]
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no such span among {[s.name for s in self.spans]}")


def attributes(span) -> dict:
    values = {}
    for item in span.attributes:
        kind = item.value.WhichOneof("value")
        values[item.key] = getattr(item.value, kind)
    return values


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


@pytest.fixture(scope="module")
def server(tiny_model: Path, receiver: OtlpReceiver, tmp_path_factory):  # type: ignore[no-untyped-def]
    site = write_fake_endpoints(tmp_path_factory.mktemp("tracing") / "site", ["hello"])
    with tiny_server(tiny_model, "--otlp-traces-endpoint", receiver.url, roots=(site,),
                     VLLM_PLUGINS="hello") as proc:
        yield proc


def test_a_completion_is_one_span_under_the_client_trace_with_engine_timings(server, receiver):
    response = httpx.post(server.url("/v1/completions"), timeout=60, headers={
        "traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}, json={
        "model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    (span,) = receiver.wait_for(lambda s: s.trace_id.hex() == TRACE_ID)
    assert span.parent_span_id.hex() == PARENT_SPAN_ID
    assert span.name == "POST /v1/completions"
    found = attributes(span)
    assert found["http.route"] == "/v1/completions"
    assert found["http.response.status_code"] == 200
    assert found["gateway.request_id"] == response.headers["x-request-id"]
    assert found["gen_ai.response.model"] == SERVED_NAME
    assert found["gen_ai.usage.completion_tokens"] == 5
    assert found["gen_ai.request.max_tokens"] == 5
    for timing in ("time_in_queue", "time_to_first_token", "time_in_model_prefill",
                   "time_in_model_decode", "e2e"):
        assert found[f"gen_ai.latency.{timing}"] >= 0
    assert found["gen_ai.latency.e2e"] >= found["gen_ai.latency.time_in_model_decode"]


def test_a_plugin_route_span_carries_the_plugin_name(server, receiver):
    response = httpx.get(server.url("/v1/hello"), timeout=30)
    assert response.status_code == 200
    (span,) = receiver.wait_for(
        lambda s: attributes(s).get("gateway.request_id") == response.headers["x-request-id"])
    assert attributes(span)["gateway.plugin.name"] == "hello"
    assert span.name == "GET /v1/hello"


def test_an_endpoint_that_does_not_answer_is_said_once_and_the_server_serves(tiny_model,
                                                                              tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1/traces"
    # A short export timeout: the exporter's retries of a batch (10 s by default) would
    # otherwise hold up the server's shutdown, which flushes the last batch.
    with tiny_server(tiny_model, "--otlp-traces-endpoint", dead,
                     log_path=tmp_path / "server.log",
                     OTEL_EXPORTER_OTLP_TRACES_TIMEOUT="1") as proc:
        for _ in range(3):
            response = httpx.post(proc.url("/v1/completions"), timeout=60, json={
                "model": SERVED_NAME, "prompt": "Hi", "max_tokens": 2})
            assert response.status_code == 200
            time.sleep(1.2)  # past the exporter's batch delay: each batch fails to send
    log = proc.log_text()
    assert log.count("does not answer") == 1
    assert "Traceback" not in log


def test_without_an_endpoint_the_sdk_is_not_imported(tiny_model):
    code = ("import sys, argparse\n"
            "from gateway.frontend.cli import serve\n"
            "from gateway.frontend.app import build_app\n"
            "from tests.frontend.conftest import EngineInfo, serve_config\n"
            "build_app(serve_config(), EngineInfo())\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
