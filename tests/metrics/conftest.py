"""Fixtures of the metrics tests: the real app with endpoint plugins and metrics attached."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gateway.frontend.app import build_app
from gateway.metrics import StatLoggerManager
from tests.frontend.conftest import EngineInfo, serve_config
from tests.frontend.fake_endpoints import MODULE, write_fake_endpoints
from tests.metrics.helpers import engine_config
from tests.plugin_dists import activate, forget_modules

#: A load record as the engine core sends it for one of its workers.
WORKER_FAILURE = {"group": "vllm.logits_processors", "name": "bad_lp", "value": "m:C",
                  "distribution": "lp-dist", "process_role": "worker-0", "pid": 1,
                  "outcome": "import-failed", "error": "ImportError: nope",
                  "load_time_s": 0.0, "detail": None}


@pytest.fixture
def app_client(site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The real app (`build_app`, no engine: its requests never generate) with three
    endpoint plugins (`crashes` fails each request, `init_raises` fails its init_state),
    metrics attached as `gateway serve` attaches them, served in-process."""
    write_fake_endpoints(site, ["hello", "crashes", "init_raises"])
    activate(site, monkeypatch)
    monkeypatch.setenv("VLLM_PLUGINS", "hello,crashes,init_raises")
    engine = EngineInfo(records=[WORKER_FAILURE])
    stat_loggers = StatLoggerManager(engine_config(), engine.model_name, enable_logging=False)
    app = build_app(serve_config(), engine, stat_loggers=stat_loggers)
    with TestClient(app) as client:
        client.stat_loggers = stat_loggers  # type: ignore[attr-defined]
        yield client
    forget_modules(MODULE)


USAGE_RECORDS_PLUGIN = Path(__file__).resolve().parents[2] / "stat_loggers" / "usage_records"


@pytest.fixture(scope="session")
def usage_records_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example stat-logger plugin, pip-installed as a user would (into a target folder,
    so the test environment itself is not changed)."""
    target = tmp_path_factory.mktemp("usage-records-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(target), str(USAGE_RECORDS_PLUGIN)],
                   check=True, capture_output=True, timeout=300)
    return target
