"""Packaging and the container: the Dockerfile passes hadolint and has the shape an operator
expects, compose gives the server time to drain, and the wheel alone, installed into a fresh
virtual environment, is a server that starts and answers."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import yaml

import gateway
from gateway.frontend import server as serving_loop
from tests.server import ServerProcess

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
HADOLINT = Path(sys.executable).with_name("hadolint")


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in lines if line and not line.startswith("#")]


def test_the_dockerfile_passes_hadolint():
    result = subprocess.run([str(HADOLINT), "--failure-threshold", "info", str(DOCKERFILE)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_container_runs_as_an_unprivileged_user():
    users = [args for name, args in dockerfile_instructions() if name == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_the_container_installs_a_cpu_torch_unless_told_otherwise():
    args = dict(arg.split("=", 1) for name, arg in dockerfile_instructions() if name == "ARG")
    assert args["TORCH_VARIANT"] == "cpu"
    assert args["TORCH_VERSION"] in (REPO / "scripts" / "setup").read_text()


def test_a_source_edit_does_not_reinstall_the_dependencies():
    steps = dockerfile_instructions()
    copy_all = steps.index(("COPY", ". ."))
    installs = [i for i, (name, args) in enumerate(steps)
                if name == "RUN" and "requirements.txt" in args]
    assert installs and installs[0] < copy_all
    copies_before = [args for name, args in steps[:copy_all] if name == "COPY"]
    assert copies_before == ["pyproject.toml ./"]


def test_compose_waits_longer_than_the_server_drains_and_gives_shared_memory():
    service = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["gateway"]
    grace_s = int(service["stop_grace_period"].rstrip("s"))
    assert grace_s > serving_loop._GRACEFUL_SHUTDOWN_S + serving_loop._ENGINE_SHUTDOWN_S
    assert service["shm_size"].endswith("gb")


def test_the_declared_version_is_the_one_the_cli_prints():
    assert importlib.metadata.version("gateway") == gateway.__version__
    result = subprocess.run([sys.executable, "-m", "gateway.frontend.cli.main", "--version"],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == f"gateway {gateway.__version__}"


def test_the_build_backend_reads_the_spdx_license():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)
    assert any(req.startswith("setuptools>=") and int(req.split(">=")[1].split(".")[0]) >= 77
               for req in project["build-system"]["requires"])


def test_the_wheel_in_a_fresh_venv_is_a_server_that_starts(tmp_path: Path, tiny_llama: Path):
    source = tmp_path / "src"  # built from a copy, so the checkout gets no build/ folder
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "gateway", source / "gateway",
                    ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist),
                    str(source)], check=True, timeout=600)
    wheel = next(dist.glob("gateway-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=900)  # the CPU build
    subprocess.run([*pip, str(wheel)], check=True, timeout=900)
    version = subprocess.run([str(venv / "bin" / "gateway"), "--version"],
                             capture_output=True, text=True, timeout=60)
    assert version.stdout.strip() == f"gateway {gateway.__version__}"
    with ServerProcess([str(tiny_llama), "--max-model-len", "128"], python=python) as server:
        response = httpx.post(server.url("/v1/completions"), timeout=60, json={
            "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
