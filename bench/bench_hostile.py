"""The hostile set of issue 40 against a real server while 8 clients stream. Not a test.

`gateway serve` (the tiny random Llama, or `--default-model`, or `--model PATH`) with
`--trust-request-chat-template`. After a warm-up (streams, a grammar, a request template:
every helper process started), the resident memory of the front end and of the engine
core is read; then `--clients` clients stream completions without pause while the hostile
requests are sent one after another:

- a JSON schema with a 100,000-value enum, then 24 distinct 20,000-value enums;
- a grammar that compiles for minutes (stopped at `--compile-timeout`);
- a schema as JSON text nested 3,000 deep, and a request body nested 3,000 deep;
- a request template `{{ 'x' * 1000000000 }}`, and one that loops 10^10 times (stopped at
  `--render-timeout`);
- a body of 2,000,000 token ids (about 9.5 MB, under the 16 MiB cap);
- 100,000 prompts in one request (past --max-seqs-per-request).

Each is expected to be refused with a 400. Prints each one's status and time, the largest
gap between two tokens the streaming clients saw (and /health's slowest answer), the
memory of the front end and engine core before and after the set (once the helpers are
quiet again), and the CPU's flags. Targets: no gap over 0.5 s; memory grown at most 5%. Exits 1
if a hostile request got another status than expected or a stream failed; a missed target
is printed, not an exit status (a shared machine's figures are noise).

    .venv/bin/python bench/bench_hostile.py [--default-model | --model PATH]
        [--clients 8] [--compile-timeout 2] [--render-timeout 2] [--rounds 2] [--quick]

`--quick` (the test's mode): two clients and the cheap cases only, with a smaller body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode import cpu_flags
from bench.bench_load import served_model_args
from tests.plugin_dists import subprocess_env
from tests.server import ServerProcess, descendant_pids

SERVED = "bench"
GAP_TARGET_S = 0.5
MEMORY_TARGET = 0.05


@dataclass
class Hostile:
    name: str
    path: str
    body: Callable[[], bytes]
    expected: int = 400
    quick: bool = True  # part of --quick


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}], **fields}


def _enum_schema(name: str, values: list[Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {name: {"enum": values}}}


def hostile_set(args: argparse.Namespace) -> list[Hostile]:
    num_ids = 200_000 if args.quick else 2_000_000
    grammar = "root ::= " + " ".join(f"[a-z]{{0,{k}}}" for k in range(20, 200))
    cases = [
        Hostile("enum of 100,000 values", "/v1/chat/completions", lambda: _json(_chat(
            structured_outputs={"json": _enum_schema("v", list(range(100_000)))}))),
        *[Hostile(f"distinct 20,000-value enum {i + 1}/24", "/v1/chat/completions",
                  lambda i=i: _json(_chat(structured_outputs={"json": _enum_schema(
                      f"v{i}", [f"{i}-{j}" for j in range(20_000)])})), quick=i < 2)
          for i in range(24)],
        Hostile("grammar compiling for minutes", "/v1/chat/completions",
                lambda: _json(_chat(structured_outputs={"grammar": grammar})), quick=False),
        Hostile("schema text nested 3,000 deep", "/v1/chat/completions",
                lambda: _json(_chat(guided_json="{" * 3000))),
        Hostile("body nested 3,000 deep", "/v1/chat/completions",
                lambda: b'{"model": "bench", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"),
        Hostile("template 'x' * 10^9", "/v1/chat/completions",
                lambda: _json(_chat(chat_template="{{ 'x' * 1000000000 }}"))),
        Hostile("template looping 10^10 times", "/v1/chat/completions", lambda: _json(_chat(
            chat_template="{% for i in range(100000) %}{% for j in range(100000) %}"
                          "{% endfor %}{% endfor %}{{ messages[0].content }}")), quick=False),
        Hostile(f"body of {num_ids:,} token ids", "/v1/completions", lambda: _json({
            "model": SERVED, "prompt": [i % 400 for i in range(num_ids)], "max_tokens": 1})),
        Hostile("100,000 prompts in one request", "/v1/completions",
                lambda: _json({"model": SERVED, "prompt": ["a"] * 100_000, "max_tokens": 1})),
    ]
    return [case for case in cases if case.quick or not args.quick]


@dataclass
class Streams:
    """What the streaming clients saw."""

    largest_gap_s: float = 0.0
    gaps: list[float] = field(default_factory=list)
    num_streams: int = 0
    num_tokens: int = 0
    failures: list[str] = field(default_factory=list)


async def stream_until(client: httpx.AsyncClient, done: asyncio.Event, seen: Streams,
                       max_tokens: int) -> None:
    body = {"model": SERVED, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    while not done.is_set():
        last = None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                seen.failures.append(f"{response.status_code}: {await response.aread()!r}")
                await asyncio.sleep(0.5)
                continue
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                if last is not None:
                    seen.gaps.append(now - last)
                    seen.largest_gap_s = max(seen.largest_gap_s, now - last)
                last = now
                seen.num_tokens += 1
        seen.num_streams += 1


async def probe_health(client: httpx.AsyncClient, done: asyncio.Event) -> float:
    slowest = 0.0
    while not done.is_set():
        started = time.monotonic()
        await client.get("/health")
        slowest = max(slowest, time.monotonic() - started)
        await asyncio.sleep(0.1)
    return slowest


async def run_set(url: str, args: argparse.Namespace, cases: list[Hostile],
                  num_clients: int | None = None
                  ) -> tuple[list[tuple[Hostile, int, float, str]], Streams, float]:
    seen, done = Streams(), asyncio.Event()
    num_clients = num_clients or args.clients
    limits = httpx.Limits(max_connections=num_clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        streams = [asyncio.create_task(stream_until(client, done, seen, args.max_tokens))
                   for _ in range(num_clients)]
        health = asyncio.create_task(probe_health(client, done))
        await asyncio.sleep(2.0)  # every client is streaming
        results = []
        for case in cases:
            content = await asyncio.to_thread(case.body)
            started = time.monotonic()
            response = await client.post(case.path, content=content,
                                         headers={"content-type": "application/json"})
            error = response.json().get("error", {}) if response.status_code != 200 else {}
            results.append((case, response.status_code, time.monotonic() - started,
                            str(error.get("message", ""))[:90]))
        await asyncio.sleep(1.0)
        done.set()
        await asyncio.gather(*streams)
        slowest_health = await health
    return results, seen, slowest_health


def warm_up(url: str) -> None:
    """Start what the set will use: a stream, a grammar compile, a request template."""
    with httpx.Client(base_url=url, timeout=300) as client:
        for body in (_chat(structured_outputs={"choice": ["yes", "no"]}),
                     _chat(chat_template="{{ messages[0].content }}"), _chat()):
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1)) / 1024


def engine_core_pid(server: ServerProcess) -> int:
    for pid in sorted(descendant_pids(server.process.pid)):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        if parent == server.process.pid and b"spawn_main" in cmdline:
            return pid
    raise RuntimeError("no engine-core process found")


def memory(server: ServerProcess) -> dict[str, float]:
    tree = {server.process.pid, *descendant_pids(server.process.pid)}
    total = 0.0
    for pid in tree:
        try:
            total += rss_mib(pid)
        except OSError:
            pass
    return {"front end": rss_mib(server.process.pid),
            "engine core": rss_mib(engine_core_pid(server)), "whole tree": total}


def settle(server: ServerProcess, seconds: float = 3.0) -> None:
    """Until the server's processes stay idle for a second (helpers replaced, compiles
    and renders stopped), at most `seconds` * 10."""
    def cpu_s() -> float:
        total = 0
        for pid in {server.process.pid, *descendant_pids(server.process.pid)}:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    deadline = time.monotonic() + seconds * 10
    time.sleep(seconds)
    while time.monotonic() < deadline:
        before = cpu_s()
        time.sleep(1.0)
        if cpu_s() - before < 0.1:
            return


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None,
                       help="model path (default: the tiny random Llama, built in a temp dir)")
    which.add_argument("--default-model", action="store_true",
                       help="serve the embedded default model")
    parser.add_argument("--clients", type=int, default=8, help="streaming clients")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--compile-timeout", type=float, default=2.0,
                        help="--structured-outputs-compile-timeout of the server")
    parser.add_argument("--render-timeout", type=float, default=2.0,
                        help="--chat-template-render-timeout of the server")
    parser.add_argument("--rounds", type=int, default=2,
                        help="times the set is sent while the clients stream (memory is "
                        "read after each)")
    parser.add_argument("--no-warm-up-set", dest="warm_up_set", action="store_false",
                        help="measure from the first pass of the set (by default one pass "
                        "runs before the memory is first read: first-time costs apart)")
    parser.add_argument("--quick", action="store_true",
                        help="two clients, the cheap cases, a smaller body (the test's mode)")
    args = parser.parse_args()
    if args.quick:
        args.clients = min(args.clients, 2)
    return args


def main() -> int:
    args = parse_args()
    cases = hostile_set(args)
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        work = Path(tmp)
        model_args = served_model_args(args, work)
        env = subprocess_env()
        env.pop("VLLM_API_KEY", None)
        serve_args = [*model_args, "--served-model-name", SERVED, "--max-model-len", "2048",
                      "--trust-request-chat-template", "--disable-uvicorn-access-log",
                      "--structured-outputs-compile-timeout", str(args.compile_timeout),
                      "--chat-template-render-timeout", str(args.render_timeout)]
        with ServerProcess(serve_args, env=env, log_path=work / "server.log") as server:
            print(f"server ready in {server.ready_after_s:.1f} s; model: "
                  f"{model_args[0] if model_args else 'default'}", flush=True)
            warm_up(server.url())
            if args.warm_up_set:  # first-time costs (lazy imports, caches, threads) apart
                asyncio.run(run_set(server.url(), args, cases, num_clients=1))
            settle(server)
            before = memory(server)
            afters, slowest_health = [], 0.0
            for _ in range(args.rounds):
                results, seen, slowest = asyncio.run(run_set(server.url(), args, cases))
                slowest_health = max(slowest_health, slowest)
                settle(server)
                afters.append(memory(server))
            alive = server.process.poll() is None
            stalls = [line for line in server.log_text().splitlines()
                      if "event loop was blocked" in line]
    return report(args, results, seen, slowest_health, before, afters, alive, stalls)


def report(args: argparse.Namespace, results: list[tuple[Hostile, int, float, str]],
           seen: Streams, slowest_health: float, before: dict[str, float],
           afters: list[dict[str, float]], alive: bool, stalls: list[str]) -> int:
    print(f"\n{'hostile request':<38}{'status':>7}{'expected':>9}{'seconds':>9}  message")
    unexpected = 0
    for case, status, seconds, message in results:
        unexpected += status != case.expected
        print(f"{case.name:<38}{status:>7}{case.expected:>9}{seconds:>9.2f}  {message}")
    gaps = sorted(seen.gaps)
    p99 = gaps[int(len(gaps) * 0.99)] if gaps else 0.0
    gap_ok = seen.largest_gap_s <= GAP_TARGET_S
    print(f"\n{args.clients} streaming clients: {seen.num_streams} streams, {seen.num_tokens} "
          f"tokens, {len(seen.failures)} failed; largest gap between two tokens "
          f"{seen.largest_gap_s:.3f} s (p99 {p99:.3f} s; target at most {GAP_TARGET_S} s: "
          f"{'met' if gap_ok else 'MISSED'}); /health's slowest answer {slowest_health:.3f} s")
    memory_ok = True
    rounds = "".join(f"{f'round {i + 1}':>9}" for i in range(len(afters)))
    print(f"\nresident memory (MiB){'before':>9}{rounds}   change")
    for role in before:
        change = afters[-1][role] / before[role] - 1
        if role != "whole tree":
            # The target bounds growth: memory handed back (malloc trimmed) is no miss.
            memory_ok &= change <= MEMORY_TARGET
        after = "".join(f"{a[role]:>9.0f}" for a in afters)
        print(f"{role:<21}{before[role]:>9.0f}{after}{change:>+9.1%}")
    print(f"memory target (front end and engine core grown at most {MEMORY_TARGET:.0%}): "
          f"{'met' if memory_ok else 'MISSED'}")
    print(f"\nthe front end's event-loop stalls logged: {len(stalls)}")
    for line in stalls[:5]:
        print("  " + line[line.index("The event loop"):][:220])
    print(f"\nCPU: {cpu_flags()}; load average now {os.getloadavg()[0]:.1f}")
    print(f"server alive after: {alive}")
    for failure in seen.failures[:5]:
        print(f"stream failure: {failure}")
    return 0 if alive and not unexpected and not seen.failures else 1


if __name__ == "__main__":
    sys.exit(main())
