"""The Kubernetes manifests of deploy/k8s, checked without a cluster: every document
against the Kubernetes API schema (kubernetes-validate's vendored OpenAPI schemas, strict:
an unknown field is an error), the gateway's own flags in them parsed by `gateway serve`'s
parser, probes on /health, and the embedded Prometheus scrape job's relabelling."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.frontend.cli.args import add_server_args, engine_config_from_args

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
KUBERNETES_VERSION = "1.30.0"  # the oldest release the manifests are meant for


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def containers(kind: str) -> list[dict[str, Any]]:
    return [container for path in MANIFESTS for doc in documents(path) if doc["kind"] == kind
            for container in doc["spec"]["template"]["spec"]["containers"]]


def _serve_args(argv: list[str]) -> argparse.Namespace:
    return add_server_args(argparse.ArgumentParser()).parse_args(argv)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_manifest_is_valid_against_the_kubernetes_schema(path):
    docs = documents(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_what_kubernetes_would():
    bad = documents(K8S / "gateway.yaml")[0]
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_the_deployment_runs_real_flags_and_probes_health():
    (container,) = containers("Deployment")
    assert container["command"][:2] == ["gateway", "serve"]
    config = engine_config_from_args(_serve_args(container["command"][2:]))
    assert config.parallel.data_parallel_size == 2
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("rank", ["0", "1"])
def test_each_multinode_pod_runs_real_flags(rank):
    (container,) = containers("StatefulSet")
    script = container["args"][0]
    flags = re.search(r"set -- (.*?)\n\s*if", script, re.S).group(1)  # type: ignore[union-attr]
    argv = flags.replace("\\\n", " ").replace('"$rank"', rank).split()
    if rank != "0":
        argv.append("--headless")
    parallel = engine_config_from_args(_serve_args(argv)).parallel
    assert (parallel.nnodes, parallel.node_rank, parallel.tensor_parallel_size) == (2, int(rank), 4)


def test_the_embedded_scrape_job_keeps_annotated_pods_and_rewrites_their_address():
    # Not promtool: Debian's promtool is built without Kubernetes service discovery and
    # refuses `kubernetes_sd_configs`. The relabelling is applied here as Prometheus would.
    (config_map,) = documents(K8S / "prometheus-scrape.yaml")
    (job,) = yaml.safe_load(config_map["data"]["prometheus.yml"])["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    pod = {"__address__": "10.0.0.7:9999", "__meta_kubernetes_pod_name": "gateway-abc",
           "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
           "__meta_kubernetes_pod_annotation_prometheus_io_port": "8000",
           "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics"}
    labels = _relabel(job["relabel_configs"], pod)
    assert labels is not None
    assert (labels["__address__"], labels["__metrics_path__"], labels["pod"]) == (
        "10.0.0.7:8000", "/metrics", "gateway-abc")
    unannotated = {k: v for k, v in pod.items() if "scrape" not in k}
    assert _relabel(job["relabel_configs"], unannotated) is None


def _relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus's `keep` and `replace` relabelling (anchored regexes, `;` separator)."""
    labels = dict(labels)
    for rule in rules:
        value = ";".join(labels.get(name, "") for name in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if match is None:
                return None
        elif match is not None:
            replacement = rule.get("replacement", "$1")
            groups = (match.group(0), *match.groups())
            labels[rule["target_label"]] = re.sub(
                r"\$(\d+)", lambda m, groups=groups: groups[int(m.group(1))] or "", replacement)
    return labels
