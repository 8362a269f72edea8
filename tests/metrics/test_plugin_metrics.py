"""The gateway's own plugin metrics, on the real app: load outcomes from the merged reports
(front end, engine core, workers) and requests and latency of plugin routes."""

from __future__ import annotations

from tests.metrics.helpers import metrics_text, promtool_problems, samples, value


def test_plugin_routes_are_counted_by_plugin_route_method_and_status(app_client):
    for _ in range(2):
        assert app_client.get("/v1/hello").status_code == 200
    assert app_client.get("/v1/crash").status_code == 500
    text = metrics_text(app_client)
    requests = "gateway_plugin_route_requests_total"
    assert value(text, requests, plugin="hello", route="/v1/hello", method="GET",
                 status="200") == 2
    assert value(text, requests, plugin="crashes", route="/v1/crash", status="500") == 1
    assert value(text, "gateway_plugin_route_latency_seconds_count", plugin="hello") == 2


def test_core_routes_unknown_paths_and_removed_plugin_routes_are_not_counted(app_client):
    app_client.get("/v1/models")
    app_client.get("/nowhere")
    assert app_client.get("/v1/init-broken").status_code == 404  # init_state failed
    routes = {dict(labels).get("route") for (name, labels) in samples(metrics_text(app_client))
              if name.startswith("gateway_plugin_route")}
    assert routes == set()


def test_load_outcomes_of_every_process_are_exposed_and_failures_counted(app_client):
    text = metrics_text(app_client)
    assert value(text, "gateway_plugin_info", group="vllm.endpoint_plugins", plugin="hello",
                 distribution="gw-test-endpoints", process="main", outcome="attached") == 1
    failures = "gateway_plugin_load_failures_total"
    assert value(text, failures, plugin="init_raises", outcome="init-failed") == 1
    assert value(text, failures, group="vllm.logits_processors", plugin="bad_lp",
                 process="worker-0", outcome="import-failed") == 1
    assert all(dict(labels)["outcome"] in ("init-failed", "import-failed")
               for (name, labels) in samples(text) if name == failures)


def test_the_apps_exposition_passes_promtool_apart_from_colons(app_client):
    app_client.get("/v1/hello")
    app_client.get("/v1/crash")
    text = metrics_text(app_client)
    assert "vllm:num_requests_running" in text and "gateway_plugin_info" in text
    assert promtool_problems(text) == []
