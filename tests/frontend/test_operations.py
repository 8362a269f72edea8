"""What an operator relies on: TLS (mutual TLS included), request logs that never hold the
key, JSON log lines carrying the request id, the start-up summary, and start-up errors
(a port in use, a bad certificate) reported in one line before the model loads."""

from __future__ import annotations

import json
import logging
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

import gateway
from gateway.frontend.http.request_logger import RequestLogger
from tests.frontend.conftest import SERVED_NAME, TINY_FLAGS
from tests.server import ServerProcess, free_port

API_KEY = "sekret-operator-key"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificate(folder: Path, name: str, subject_alt_name: str) -> None:
    """`name`.pem / `name`.key signed by the CA in `folder`."""
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)
    (folder / f"{name}.ext").write_text(f"subjectAltName={subject_alt_name}\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext",
            cwd=folder)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate."""
    folder = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca",
            cwd=folder)
    make_certificate(folder, "server", "IP:127.0.0.1")
    make_certificate(folder, "client", "DNS:client")
    return folder


def client_context(certs: Path, with_certificate: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if with_certificate:
        context.load_cert_chain(certs / "client.pem", certs / "client.key")
    return context


@pytest.fixture(scope="module")
def server(tiny_model: Path, certs: Path):  # type: ignore[no-untyped-def]
    args = [str(tiny_model), *TINY_FLAGS, "--api-key", API_KEY,
            "--ssl-keyfile", str(certs / "server.key"), "--ssl-certfile", str(certs / "server.pem"),
            "--ssl-ca-certs", str(certs / "ca.pem"), "--ssl-cert-reqs", "2",
            "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "5",
            "--log-format", "json"]
    with ServerProcess(args, scheme="https",
                       client_options={"verify": client_context(certs)}) as proc:
        yield proc


def log_entries(server: ServerProcess) -> list[dict]:
    return [json.loads(line) for line in server.log_text().splitlines() if line.strip()]


def test_https_with_a_client_certificate_serves_and_still_needs_the_key(server, certs):
    with httpx.Client(verify=client_context(certs), timeout=60) as http:
        assert http.get(server.url("/v1/models")).status_code == 401
        client = openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, http_client=http)
        completion = client.completions.create(model=SERVED_NAME, prompt="Hello world",
                                               max_tokens=3, temperature=0)
    assert completion.usage.completion_tokens >= 1


def test_a_client_without_a_certificate_is_refused(server, certs):
    with pytest.raises(httpx.TransportError):
        with httpx.Client(verify=client_context(certs, with_certificate=False)) as http:
            http.get(server.url("/health"))


def test_a_client_that_does_not_trust_the_server_certificate_gets_no_answer(server):
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url("/health"))


def test_requests_are_logged_with_their_id_cut_to_max_log_len_and_never_the_key(server, certs):
    with httpx.Client(verify=client_context(certs), timeout=60) as http:
        response = http.post(server.url("/v1/completions"), json={
            "model": SERVED_NAME, "prompt": "Hello world, how are you today?", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    about = [e for e in log_entries(server) if e.get("request_id") == request_id]
    received = [e["message"] for e in about if e["message"].startswith("Received request")]
    finished = [e["message"] for e in about if e["message"].startswith("Finished request")]
    assert len(received) == 1 and len(finished) == 1
    assert "prompt: 'Hello'" in received[0]
    assert "prompt tokens:" in received[0] and "max_tokens=4" in received[0]
    assert "output tokens: 4" in finished[0] and "finish_reason: length" in finished[0]
    assert API_KEY not in server.log_text()


def test_every_log_line_of_every_process_is_json(server):
    entries = log_entries(server)  # raises on a line that is not JSON
    assert {"api-server", "engine"} <= {_process_kind(e) for e in entries}
    assert all({"time", "level", "logger", "pid", "message"} <= set(e) for e in entries)


def _process_kind(entry: dict) -> str:
    return "engine" if entry["logger"].startswith(("gateway.engine.core", "gateway.worker")) \
        else "api-server"


def test_the_start_up_summary_names_version_flags_routes_and_address(server):
    messages = [e["message"] for e in log_entries(server)]
    assert any(m.startswith(f"gateway {gateway.__version__}: serving") for m in messages)
    flags = next(m for m in messages if m.startswith("Non-default arguments:"))
    assert "'api_key': '***'" in flags and "'ssl_cert_reqs': 2" in flags
    routes = next(m for m in messages if m.startswith("Routes:"))
    assert "POST /v1/completions (core)" in routes and "GET /health (core)" in routes
    assert (f"Listening on https://127.0.0.1:{server.port} (client certificates required)"
            in messages)


def test_the_worker_says_which_dtype_it_chose_and_why(server, tiny_model):
    from gateway.models.info.paths import read_model_info
    from gateway.models.loading.loader import explain_dtype
    from gateway.platforms.cpu import CpuPlatform

    why = explain_dtype("auto", CpuPlatform, read_model_info(str(tiny_model)))
    assert why.startswith("auto: ")  # bfloat16 only on a CPU that has it natively
    (line,) = [e["message"] for e in log_entries(server) if e["message"].startswith("Worker 0:")]
    assert "(cpu platform)" in line and why in line


def test_the_kv_cache_size_and_concurrency_line_is_logged_on_the_cpu(server):
    messages = [e["message"] for e in log_entries(server)]
    (worker,) = [m for m in messages if m.startswith("KV cache: ")]
    num_blocks = int(worker.split()[2])  # "KV cache: N blocks of 16 tokens (... GiB)"
    assert int(64 * 2**20 // num_blocks) in (2048, 4096)  # the tiny model's block: 2 or 4 KiB
    (line,) = [m for m in messages if "KV cache size:" in m]
    assert line == (f"CPU KV cache size: {num_blocks * 16:,} tokens, Maximum concurrency for "
                    f"2,048 tokens per request: {num_blocks / 128:.2f}x")


def run_serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.frontend.cli.main", "serve", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_port_in_use_is_reported_before_the_model_loads(tiny_model):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result = run_serve(str(tiny_model), "--port", str(port))
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert "Engine core ready" not in result.stderr


@pytest.mark.parametrize("flags, message", [
    (("--ssl-keyfile", "/no/such.key", "--ssl-certfile", "/no/such.pem"),
     "cannot load the TLS files"),
    (("--ssl-certfile", "/no/such.pem"), "TLS needs both --ssl-keyfile and --ssl-certfile"),
])
def test_bad_tls_files_stop_start_up_in_one_line(tiny_model, flags, message):
    result = run_serve(str(tiny_model), "--port", str(free_port()), *flags)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "Cannot start" in line]
    assert len(errors) == 1 and message in errors[0]
    assert "Engine core ready" not in result.stderr


@pytest.mark.parametrize("origins", [None, '["*"]', '["https://app.example", "*"]'])
def test_credentials_with_wildcard_origins_stop_start_up_in_one_line(tiny_model, origins):
    """Starlette would echo any website's Origin with credentials allowed: refused."""
    flags = ("--allowed-origins", origins) if origins else ()
    result = run_serve(str(tiny_model), "--port", str(free_port()), "--allow-credentials",
                       *flags)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.stderr
    assert "--allow-credentials" in errors[0] and "--allowed-origins" in errors[0]
    assert "Engine core ready" not in result.stderr


def test_max_log_len_zero_logs_no_prompt_text(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="gateway.requests"):
        RequestLogger(max_log_len=0).log_inputs("req-1", "secret prompt", [5, 6, 7], "params")
    assert caplog.messages == ["Received request req-1: prompt: '', params: params, "
                               "prompt_token_ids: [], prompt tokens: 3."]
