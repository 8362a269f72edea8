"""Long-form load run against the real server on loopback. Not a test.

`gateway serve` with the example endpoint plugins (summarize, server_info) allowlisted, then
the driver of tests/reliability/load.py: a warm-up, then N requests (default 2,000) at
concurrency C (default 64) over the fixed mix (completions and chat, streamed and whole,
/tokenize, GET /v1/server-info, GET /metrics), every answer checked (200 only, complete,
streams ending in [DONE], usage consistent). Prints requests/s, p50/p99 latency by kind, and
the server's resident memory (summed over its process tree) after warm-up and after the run.
Exits 1 if any check failed.

    .venv/bin/python bench/bench_load.py [--model PATH | --default-model] [--requests 2000]
        [--concurrency 64] [--warmup 400] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.entrypoints.conftest import EXAMPLE_PLUGINS, REPO
from tests.plugin_dists import subprocess_env
from tests.reliability.load import run_load, server_rss_by_process, server_rss_bytes
from tests.server import ServerProcess

SERVED = "bench"


def install_example_plugins(work: Path) -> Path:
    target, sources = work / "site", work / "plugin-sources"
    folders = [str(shutil.copytree(REPO / "endpoint_plugins" / name, sources / name))
               for name in EXAMPLE_PLUGINS]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(target), *folders], check=True, capture_output=True, timeout=300)
    return target


def main() -> int:
    parser = argparse.ArgumentParser()
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None,
                       help="model path (default: the tiny random Llama, built in a temp dir)")
    which.add_argument("--default-model", action="store_true",
                       help="serve the embedded default model")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        work = Path(tmp)
        if args.default_model:
            model_args: list[str] = []
        elif args.model:
            model_args = [args.model]
        else:
            from tests.tiny_model import build_tiny_llama
            model_args = [str(build_tiny_llama(work / "tiny-llama"))]
        site = install_example_plugins(work)
        env = subprocess_env(site, VLLM_PLUGINS=",".join(EXAMPLE_PLUGINS))
        env.pop("VLLM_API_KEY", None)
        serve_args = [*model_args, "--served-model-name", SERVED, "--max-model-len", "2048",
                      "--kv-cache-memory", args.kv_cache_memory, "--disable-uvicorn-access-log"]
        with ServerProcess(serve_args, env=env, log_path=work / "server.log") as server:
            pid = server.process.pid
            print(f"server ready in {server.ready_after_s:.1f} s; model: "
                  f"{model_args[0] if model_args else 'default'}")
            warm = asyncio.run(run_load(server.url(), SERVED, args.warmup, args.concurrency,
                                        max_tokens=args.max_tokens))
            time.sleep(0.5)
            rss_warm = server_rss_bytes(pid)
            result = asyncio.run(run_load(server.url(), SERVED, args.requests,
                                          args.concurrency, max_tokens=args.max_tokens))
            time.sleep(0.5)
            rss_after = server_rss_bytes(pid)
            per_process = server_rss_by_process(pid)
            alive = server.process.poll() is None

    faults = warm.faults + result.faults
    print(f"\n{result.sent} sent, {result.answered} answered at concurrency "
          f"{args.concurrency} (max_tokens {args.max_tokens}, ignore_eos) in "
          f"{result.elapsed_s:.2f} s: {result.requests_per_s:.1f} requests/s, "
          f"{result.generated_tokens / result.elapsed_s:.0f} generated tokens/s")
    print(f"statuses: {dict(result.statuses)}; server alive after: {alive}")
    print(f"\n{'kind':<30}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}")
    for kind, (count, p50, p99) in result.percentiles().items():
        print(f"{kind:<30}{count:>6}{p50 * 1e3:>10.1f}{p99 * 1e3:>10.1f}")
    growth = rss_after / rss_warm - 1
    print(f"\nRSS (server tree): after {args.warmup}-request warm-up "
          f"{rss_warm / 2**20:.0f} MiB, after the run {rss_after / 2**20:.0f} MiB "
          f"({growth:+.1%}); by process after: "
          + ", ".join(f"{p}: {b / 2**20:.0f} MiB" for p, b in per_process.items()))
    ok = (not faults and result.sent == result.answered == args.requests
          and set(result.statuses) == {200} and alive)
    print(f"\nfaults: {len(faults)}" + "".join(f"\n  {f}" for f in faults[:20]))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
