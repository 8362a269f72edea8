"""Long-form load run against the real server on loopback. Not a test.

`gateway serve` with the example endpoint plugins (summarize, server_info) allowlisted, then
the driver of tests/reliability/load.py: a warm-up, then N requests (default 2,000) at
concurrency C (default 64) over the fixed mix (completions and chat, streamed and whole,
/tokenize, GET /v1/server-info, GET /metrics), every answer checked (200 only, complete,
streams ending in [DONE], usage consistent). Prompts are a few tokens and max_tokens fixed,
or with `--varied` mixed: prompts of 3 to 700 words (about 900 tokens), max_tokens 2 to
192, different for each request (`load.varied_shapes`); the warm-up then starts with one
request per client of the largest shape (the largest batch and contexts the mix reaches)
and goes on with other requests of the same mix.

Prints requests/s, output tokens/s, p50/p99 latency by kind, the CPU flags and the dtype
(the worker's start-up line), and the resident memory of the server's whole process tree
(front end, engine core, workers) after the warm-up, through the run and at its end, with
the growth against the target (`--rss-target`, 5%). Exits 1 if a check failed or memory
grew past the target. The server runs with `--max-queue-time 0` (every request waits its
turn: memory is measured here, not load shedding); a client waits up to `--timeout` s.

The memory check on the default model (it runs for a long time; run it alone, the figures
of a shared machine are noise):

    .venv/bin/python bench/bench_load.py --default-model --varied --requests 2000 \
        --concurrency 64

    .venv/bin/python bench/bench_load.py [--model PATH | --default-model] [--varied]
        [--requests 2000] [--concurrency 64] [--warmup 400] [--max-tokens 8]
        [--max-prompt-words 700] [--kv-cache-memory SIZE] [--rss-target 0.05]
        [--timeout 600]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode import cpu_flags
from tests.frontend.conftest import EXAMPLE_PLUGINS, REPO
from tests.plugin_dists import subprocess_env
from tests.reliability.load import (
    LoadResult,
    Shape,
    fixed_shapes,
    peak_shapes,
    run_load,
    server_rss_by_process,
    server_rss_bytes,
    varied_shapes,
)
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None,
                       help="model path (default: the tiny random Llama, built in a temp dir)")
    which.add_argument("--default-model", action="store_true",
                       help="serve the embedded default model")
    parser.add_argument("--varied", action="store_true",
                        help="mixed prompt lengths and max_tokens (else short, fixed)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=8, help="without --varied")
    parser.add_argument("--max-prompt-words", type=int, default=700,
                        help="with --varied: the longest prompt (lower it for a model whose "
                        "tokenizer makes more than 2 tokens of a word)")
    parser.add_argument("--kv-cache-memory", default=None, help="default: the server's")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a client waits for one answer")
    parser.add_argument("--rss-target", type=float, default=0.05,
                        help="the most the tree's RSS may grow after the warm-up (0.05: 5%%)")
    return parser.parse_args()


class RssTrace:
    """The server tree's RSS, sampled every `every` answers of the measured run."""

    def __init__(self, pid: int, every: int) -> None:
        self.pid, self.every = pid, max(1, every)
        self.samples: list[tuple[int, int]] = []  # (answers so far, bytes)

    async def on_progress(self, answered: int) -> None:
        if answered % self.every == 0:
            self.samples.append((answered, server_rss_bytes(self.pid)))


async def warm_up(url: str, args: argparse.Namespace, shape: Shape) -> LoadResult:
    """With --varied, first one request per client of the largest shape (the longest
    prompt, the most tokens: the largest batches and contexts the mix reaches, whose
    buffers then stay with the process); then `--warmup` other requests of the mix
    (indices after the measured run's)."""
    result = LoadResult()
    if args.varied:
        result = await run_load(url, SERVED, args.concurrency, args.concurrency,
                                shape=peak_shapes(args.max_prompt_words),
                                timeout_s=args.timeout)
    mixed = await run_load(url, SERVED, args.warmup, args.concurrency, shape=shape,
                           first_index=args.requests, timeout_s=args.timeout)
    mixed.faults += result.faults
    return mixed


def served_model_args(args: argparse.Namespace, work: Path) -> list[str]:
    """`gateway serve`'s model argument from --default-model / --model, else a tiny random
    Llama written under `work`."""
    if args.default_model:
        return []
    if args.model:
        return [args.model]
    from tests.tiny_model import build_tiny_llama
    return [str(build_tiny_llama(work / "tiny-llama"))]


def main() -> int:
    args = parse_args()
    shape = varied_shapes(max_words=args.max_prompt_words) if args.varied \
        else fixed_shapes(args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        work = Path(tmp)
        model_args = served_model_args(args, work)
        site = install_example_plugins(work)
        env = subprocess_env(site, VLLM_PLUGINS=",".join(EXAMPLE_PLUGINS))
        env.pop("VLLM_API_KEY", None)
        # --max-queue-time 0: every request waits its turn (measured here: memory, not
        # load shedding).
        serve_args = [*model_args, "--served-model-name", SERVED, "--max-model-len", "2048",
                      "--max-queue-time", "0", "--disable-uvicorn-access-log"]
        if args.kv_cache_memory:
            serve_args += ["--kv-cache-memory", args.kv_cache_memory]
        with ServerProcess(serve_args, env=env, log_path=work / "server.log") as server:
            pid = server.process.pid
            print(f"server ready in {server.ready_after_s:.1f} s; model: "
                  f"{model_args[0] if model_args else 'default'}", flush=True)
            warm = asyncio.run(warm_up(server.url(), args, shape))
            time.sleep(0.5)
            rss_warm = server_rss_bytes(pid)
            per_process_warm = server_rss_by_process(pid)
            trace = RssTrace(pid, args.requests // 10)
            result = asyncio.run(run_load(server.url(), SERVED, args.requests,
                                          args.concurrency, shape=shape,
                                          timeout_s=args.timeout,
                                          on_progress=trace.on_progress))
            time.sleep(0.5)
            rss_after = server_rss_bytes(pid)
            per_process = server_rss_by_process(pid)
            alive = server.process.poll() is None
            worker = re.search(r"Worker 0: .*", server.log_text())
    return report(args, warm, result,
                  (rss_warm, trace, rss_after, per_process_warm, per_process), alive,
                  worker.group(0) if worker else "?")


def report(args: argparse.Namespace, warm: LoadResult, result: LoadResult,
           memory: tuple[int, RssTrace, int, dict[int, int], dict[int, int]], alive: bool,
           worker_line: str) -> int:
    rss_warm, trace, rss_after, per_process_warm, per_process = memory
    faults = warm.faults + result.faults
    mix = "varied prompts and max_tokens" if args.varied else f"max_tokens {args.max_tokens}"
    print(f"\n{result.sent} sent, {result.answered} answered at concurrency "
          f"{args.concurrency} ({mix}, ignore_eos) in {result.elapsed_s:.2f} s: "
          f"{result.requests_per_s:.1f} requests/s, "
          f"{result.generated_tokens / result.elapsed_s:.0f} output tokens/s "
          f"({result.generated_tokens} tokens)")
    print(f"statuses: {dict(result.statuses)}; server alive after: {alive}")
    print(f"\n{'kind':<30}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}")
    for kind, (count, p50, p99) in result.percentiles().items():
        print(f"{kind:<30}{count:>6}{p50 * 1e3:>10.1f}{p99 * 1e3:>10.1f}")
    print(f"\nCPU: {cpu_flags()}")
    print(f"dtype: {worker_line}")
    growth = rss_after / rss_warm - 1
    peak = f"{args.concurrency} of the largest shape and " if args.varied else ""
    print(f"\nRSS (server tree): after the warm-up ({peak}{args.warmup} requests) "
          f"{rss_warm / 2**20:.0f} MiB, after the run {rss_after / 2**20:.0f} MiB "
          f"({(rss_after - rss_warm) / 2**20:+.0f} MiB, {growth:+.1%}; target at most "
          f"{args.rss_target:+.0%})")
    print("by process (pid: after the warm-up -> at the end): " + ", ".join(
        f"{p}: {per_process_warm.get(p, 0) / 2**20:.0f} -> {b / 2**20:.0f} MiB"
        for p, b in per_process.items()))
    print("RSS through the run: " + ", ".join(
        f"{answered}: {size / 2**20:.0f}" for answered, size in trace.samples) + " MiB")
    checks_ok = (not faults and result.sent == result.answered == args.requests
                 and set(result.statuses) == {200} and alive)
    memory_ok = growth <= args.rss_target
    print(f"\nfaults: {len(faults)}" + "".join(f"\n  {f}" for f in faults[:20]))
    print(f"memory: {'within' if memory_ok else 'OVER'} the target")
    print("PASS" if checks_ok and memory_ok else "FAIL")
    return 0 if checks_ok and memory_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
