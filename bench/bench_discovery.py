"""Discovery and loading cost of all six plugin groups, ours against the reference pattern.

The reference pattern (vLLM's) calls `importlib.metadata.entry_points(group=...)` once per
group at each load, and each call reads every installed distribution. Ours scans once per
process for all groups. Both run here, on the same fake site of N distributions (each with
one entry point in one of the six groups, round-robin), each in a fresh interpreter so
neither profits from the other's file-system cache more than the OS gives both.

    python bench/bench_discovery.py [--sizes 10,200,1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.plugin_dists import subprocess_env, write_dist  # noqa: E402

GROUPS = ["vllm.general_plugins", "vllm.platform_plugins", "vllm.io_processor_plugins",
          "vllm.stat_logger_plugins", "vllm.endpoint_plugins", "vllm.logits_processors"]

OURS = """
import time, json
t0 = time.perf_counter()
from gateway.plugins import load_plugins_by_group, ALL_GROUPS
t1 = time.perf_counter()
for g in ALL_GROUPS:
    load_plugins_by_group(g)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1}))
"""

REFERENCE = """
import time, json, importlib.metadata as md
t1 = time.perf_counter()
for g in GROUPS:
    for ep in md.entry_points(group=g):
        ep.load()
t2 = time.perf_counter()
print(json.dumps({"load_s": t2 - t1}))
""".replace("GROUPS", repr(GROUPS), 1)


def make_site(root: Path, n: int) -> None:
    module = "def f():\n    pass\nclass C:\n    pass\n"
    for i in range(n):
        group = GROUPS[i % len(GROUPS)]
        write_dist(root, f"bench-plugin-{i}", {group: {f"p{i}": f"bench_mod_{i}:f"}},
                   {f"bench_mod_{i}": module})


def run(code: str, root: Path, env_extra: dict[str, str]) -> dict[str, float]:
    env = subprocess_env(root, VLLM_PLUGINS="", **env_extra)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout)


def wall(cmd: list[str], root: Path) -> float:
    env = subprocess_env(root)
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, env=env, check=False)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10,200,1000")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{'dists':>6} {'ours ms':>9} {'reference ms':>13} {'ratio':>7} "
          f"{'gateway plugins s':>18}")
    for n in [int(s) for s in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            make_site(root, n)
            # The allowlist is empty for both, so the measured cost is discovery, not
            # importing N modules (identical work in both).
            ours = min(run(OURS, root, {})["load_s"] for _ in range(args.repeat))
            ref = min(run(REFERENCE.replace("ep.load()", "pass"), root, {})["load_s"]
                      for _ in range(args.repeat))
            cli = min(wall([sys.executable, "-m", "gateway.frontend.cli.main", "plugins"],
                           root) for _ in range(args.repeat))
            print(f"{n:>6} {ours * 1e3:>9.1f} {ref * 1e3:>13.1f} {ours / ref:>7.2f} {cli:>18.2f}")
    print("ratio = ours / reference (target at 1,000 distributions: <= 0.25)")


if __name__ == "__main__":
    os.environ.pop("VLLM_PLUGINS", None)
    main()
