"""The deployment files (docker-compose.yml, Dockerfile, deploy/), checked without Docker:
the compose file against the Compose Specification's JSON schema, the Prometheus config
with promtool, and every dashboard query against the metrics the gateway really exports."""

from __future__ import annotations

import json
import re
import subprocess
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.metrics.helpers import PROMTOOL, exposed_names, metrics_text, outputs

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "gateway.json"
# Grafana's variables, as Prometheus would see them after Grafana substitutes them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$model_name": ".*"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset", "inf", "nan"}


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def dashboard_queries() -> list[str]:
    """Each PromQL expression of the dashboard: panel targets and template variables."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    for variable in board.get("templating", {}).get("list", []):
        query = variable.get("query")
        match = re.fullmatch(r"label_values\((.+),\s*\w+\)", query or "")
        if match:
            exprs.append(match.group(1))
    return [substitute(expr) for expr in exprs]


def substitute(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (its syntax is checked by promtool)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)  # label matchers, ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.:])[a-zA-Z_:][\w:]*", expr):
        rest = expr[match.end():].lstrip()
        if not rest.startswith("(") and match.group().lower() not in PROMQL_WORDS:
            names.add(match.group())
    return names


def test_the_compose_file_is_valid_against_the_compose_specification():
    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    jsonschema.validators.validator_for(schema)(schema).validate(compose())


def test_compose_runs_the_gateway_from_the_dockerfile_with_prometheus_and_grafana():
    services = compose()["services"]
    assert set(services) == {"gateway", "prometheus", "grafana"}
    assert services["gateway"]["build"] == "." and (REPO / "Dockerfile").is_file()
    assert "0.0.0.0" in services["gateway"]["command"]
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{service} mounts missing {source}"


def test_the_prometheus_config_passes_promtool_and_scrapes_the_gateway():
    config = REPO / "deploy" / "prometheus.yml"
    proc = subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job,) = yaml.safe_load(config.read_text())["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["gateway:8000"]


def test_grafana_provisions_the_data_source_the_dashboard_uses():
    provisioning = REPO / "deploy" / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["url"] == "http://prometheus:9090"
    board = json.loads(DASHBOARD.read_text())
    # Every query goes through the `datasource` variable, so the dashboard imports into any
    # Grafana; the provisioned source is the default, which the variable starts on.
    used = {t["datasource"]["uid"] for p in board["panels"] for t in p["targets"]}
    assert used == {"${datasource}"}
    (variable,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert variable["name"] == "datasource" and variable["query"] == source["type"]
    assert source["isDefault"] is True
    assert '"uid": "' + source["uid"] + '"' not in DASHBOARD.read_text()
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "gateway.yml").read_text())[
        "providers"]
    mounts = compose()["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in mounts


def test_every_dashboard_query_parses(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr}
        for i, expr in enumerate(dashboard_queries())]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    proc = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("expr, names", [
    ('sum by (le) (rate(vllm:x_bucket{model_name=~"a"}[1m]))', {"vllm:x_bucket"}),
    ("histogram_quantile(0.99, sum by (le, plugin) (rate(g_bucket[5m])))", {"g_bucket"}),
    ("a_total / ignoring(x) b + 1e3", {"a_total", "b"}),
])
def test_metric_names_are_read_from_promql(expr, names):
    assert metric_names(expr) == names


def test_the_dashboard_queries_only_metrics_the_gateway_exports(app_client):
    app_client.get("/v1/hello")
    app_client.get("/v1/crash")
    app_client.stat_loggers.on_outputs(outputs())
    exported = exposed_names(metrics_text(app_client))
    queried = set().union(*(metric_names(expr) for expr in dashboard_queries()))
    assert queried - exported == set()
    for needed in ("vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "gateway_plugin_load_failures_total", "gateway_http_requests_total",
                   "process_resident_memory_bytes", "vllm:iteration_tokens_total_bucket"):
        assert needed in queried  # throughput, latency, queue, KV usage, plugin failures
