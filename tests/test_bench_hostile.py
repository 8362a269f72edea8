"""bench/bench_hostile.py's quick mode: a real server, real streaming clients, the cheap
cases of the hostile set; every case gets its expected status and the report has the
stream gap, memory and CPU lines."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_the_quick_hostile_set_is_refused_while_clients_stream() -> None:
    run = subprocess.run([sys.executable, "bench/bench_hostile.py", "--quick", "--rounds",
                          "1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    out = run.stdout
    cases = re.findall(r"^(.{38})\s*(\d{3})\s+(\d{3})\s+[\d.]+ ", out, re.MULTILINE)
    assert len(cases) == 8, out
    assert all(status == expected == "400" for _, status, expected in cases), out
    streams = re.search(r"(\d+) streams, (\d+) tokens, 0 failed; largest gap between two "
                        r"tokens ([\d.]+) s", out)
    assert streams is not None and int(streams.group(1)) >= 2, out
    for role in ("front end", "engine core", "whole tree"):
        assert re.search(rf"^{role}\s+\d+\s+\d+\s+[+-][\d.]+%$", out, re.MULTILINE), out
    assert "memory target (front end and engine core grown at most 5%)" in out
    assert re.search(r"^CPU: .*avx2=(yes|no)", out, re.MULTILINE), out
    assert "server alive after: True" in out
