"""bench/bench_spec.py's tiny mode: two real servers (with and without n-gram drafts) on a
tiny random model; the report has the CPU flags, both throughputs, the ratio, the
acceptance figures, and identical greedy answers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_the_tiny_spec_bench_reports_ratio_and_acceptance() -> None:
    run = subprocess.run([sys.executable, "bench/bench_spec.py", "--tiny"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    out = run.stdout
    assert re.search(r"^CPU: .*avx2=(yes|no)", out, re.MULTILINE), out
    assert re.search(r"^dtype asked: float32", out, re.MULTILINE), out
    for label in ("without", "ngram"):
        assert re.search(rf"^{label}\s+\d+\s+[\d.]+\s+[\d.]+$", out, re.MULTILINE), out
    assert re.search(r"^ratio \(with / without speculation\): [\d.]+x$", out, re.MULTILINE)
    acceptance = re.search(r"^acceptance rate: ([\d.]+)% \((\d+) of (\d+) draft tokens",
                           out, re.MULTILINE)
    assert acceptance is not None and int(acceptance.group(3)) > 0, out
    assert re.search(r"^mean acceptance length: [\d.]+ tokens per verifying step$", out,
                     re.MULTILINE), out
    assert "identical answers: 2 of 2" in out
