"""The real Prometheus server (Debian's `prometheus`) on a free loopback port, scraping
given targets every second, for tests:

    with PrometheusServer(["127.0.0.1:8000"], tmp_path) as prometheus:
        prometheus.query('vllm:generation_tokens_total')

Its TSDB lives in the test's temporary folder; stopping sends SIGTERM and waits.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from tests.server import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


class PrometheusServer:
    def __init__(self, targets: list[str], folder: Path, scrape_interval: str = "1s") -> None:
        self.port = free_port()
        self.folder = folder
        self.config_path = folder / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump({
            "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval},
            "scrape_configs": [{"job_name": "gateway", "metrics_path": "/metrics",
                                "static_configs": [{"targets": targets}]}]}))
        self.log_path = folder / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self, timeout_s: float = 60.0) -> PrometheusServer:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={self.config_path}",
                 f"--storage.tsdb.path={self.folder / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n"
                                   f"{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url("/-/ready"), timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"prometheus not ready:\n{self.log_path.read_text()[-3000:]}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of `promql` (Prometheus' own HTTP query API)."""
        response = httpx.get(self.url("/api/v1/query"), params={"query": promql}, timeout=5.0)
        body = response.json()
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def scalar(self, promql: str) -> float | None:
        """The value of a one-element result, or None while the query returns nothing."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if len(result) == 1 else None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
