"""bench/bench_gpu.py's dry run: the GPU benchmark's whole pipeline on the CPU (tiny random
models made with transformers, real servers, real streaming clients, transformers' generate,
the gateway's worker under torch.profiler), and the JSON it writes has every section, with
numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
MODELS = ("llama1b", "smollm2")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench-gpu")
    # time boxes tripled: a busy test machine must not turn a slow phase into a failure
    run = subprocess.run([sys.executable, "bench/bench_gpu.py", "--dry-run", "--out", str(out),
                          "--box-scale", "3", "--budget-s", "900"],
                         cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads((out / "bench_gpu.json").read_text()), (out / "bench_gpu.txt").read_text()


def test_every_phase_ran(dry_run: tuple[dict[str, Any], str]) -> None:
    results, _ = dry_run
    phases = results["phases"]
    assert list(phases) == ["models", "serve-llama1b", "serve-smollm2", "transformers",
                            "profile"]
    assert {name: phase["status"] for name, phase in phases.items()} == \
        dict.fromkeys(phases, "ok"), phases


def test_models_and_bandwidth_floor(dry_run: tuple[dict[str, Any], str]) -> None:
    results, _ = dry_run
    for name in MODELS:
        model = results["models"][name]
        assert model["parameters"] > 0 and model["weight_bytes"] == 2 * model["parameters"]
        assert results["bandwidth"]["floors"][name]["floor_ms_per_step"] > 0
    assert results["bandwidth"]["gb_per_s"] > 0


@pytest.mark.parametrize("name", MODELS)
def test_serving_figures(dry_run: tuple[dict[str, Any], str], name: str) -> None:
    results, _ = dry_run
    serving = results["serving"][name]
    assert serving["startup_s"] > 0 and serving["dtype"] == "float32"
    assert all(_is_number(serving["first_request"][key])
               for key in ("ttft_ms", "itl_p50_ms", "itl_max_ms"))
    assert list(serving["levels"]) == [str(c) for c in results["meta"]["concurrencies"]]
    for level in serving["levels"].values():
        assert (level["failed"], level["unfinished"]) == (0, 0), level
        assert level["completed"] == level["requests"] > 0
        assert all(_is_number(level[key]) for key in (
            "output_tok_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms"))
        assert level["output_tokens"] == level["completed"] * results["meta"]["output_len"]


def test_transformers_profile_and_equality(dry_run: tuple[dict[str, Any], str]) -> None:
    results, _ = dry_run
    for name in MODELS:
        for run in results["transformers"]["generate"][name].values():
            assert run["tok_s"] > 0 and run["ms_per_step"] > 0
    batches = results["profile"]["batches"]
    assert batches and all(run["wall_ms_per_step"] > 0 and run["kernel_ms_per_step"] > 0
                           and run["kernels_per_step"] > 0 for run in batches.values())
    # float32 on both sides: the server's greedy tokens are transformers'
    assert len(results["equality"]) == len(MODELS)
    assert all(found["equal"] for found in results["equality"].values()), results["equality"]


def test_targets_and_report(dry_run: tuple[dict[str, Any], str]) -> None:
    results, report = dry_run
    assert all(_is_number(row["value"]) and row["met"] is not None
               for row in results["targets"])
    for heading in ("device:", "gateway commit:", "phases:", "gateway serve", "transformers",
                    "profile", "greedy equality", "targets"):
        assert heading in report
