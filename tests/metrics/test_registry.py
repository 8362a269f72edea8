"""The app's registries: one per app, and prometheus_client's multiprocess mode."""

from __future__ import annotations

import json

from gateway.metrics.registry import MetricSpec, make_registries
from tests.conftest import run_python

MULTIPROCESS = """
import json
from gateway.metrics import StatLoggerManager
from gateway.metrics.registry import make_registries
from tests.metrics.helpers import engine_config, exposition, outputs, value

registries = make_registries()
stat_loggers = StatLoggerManager(engine_config(), "tiny", enable_logging=False,
                                 registries=registries)
stat_loggers.on_outputs(outputs(running=3, generated=4))
stat_loggers.on_outputs(outputs(running=2, generated=5))
text = exposition(registries.exposition)
print(json.dumps({
    "separate": registries.registry is not registries.exposition,
    "running": value(text, "vllm:num_requests_running", model_name="tiny"),
    "generated": value(text, "vllm:generation_tokens_total", model_name="tiny"),
    "declared_elsewhere": "vllm:" in exposition(registries.registry),
}))
"""


def test_one_process_renders_the_registry_it_declares_in(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    registries = make_registries()
    assert registries.registry is registries.exposition and registries.multiprocess_dir is None
    assert make_registries().registry is not registries.registry


def test_a_name_declared_twice_is_one_metric():
    registries = make_registries()
    spec = MetricSpec("gateway_test_total", "counter", "A test counter.")
    first = registries.declare((spec,))["gateway_test_total"]
    assert registries.declare((spec,))["gateway_test_total"] is first


def test_multiprocess_mode_sums_files_and_gauges_keep_the_most_recent_value(tmp_path):
    proc = run_python(MULTIPROCESS, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result == {"separate": True, "running": 2.0, "generated": 9.0,
                      "declared_elsewhere": True}
    assert any(tmp_path.glob("*.db"))  # the values live in the folder's files
