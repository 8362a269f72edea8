"""bench_gpu.py's phases that serve a model with the real `gateway serve` (a subprocess in a
session of its own, on a free loopback port, ready when /health answers 200) and drive it
with streaming clients of our own (asyncio + httpx; beyond `clients_per_process` clients,
several client processes, so that parsing the streams never limits what is measured):

- serve: start-up time; the first request after start-up (is it as fast as later ones?);
  the greedy tokens of the equality prompts; then for each concurrency a short warm-up
  and `requests_per_client` streamed completions per client (token-id prompts, EOS
  ignored, temperature 0): output tok/s, ITL p50/p99 (the gaps between a stream's
  events, as `vllm bench serve` counts them), TTFT p50, failed and unfinished requests;
- greedy: the greedy tokens only, with extra server flags (--dtype float32).

Every step has its share of the phase's time box: at its end the outstanding requests are
cancelled (the client disconnects, the server aborts them) and counted as unfinished.

    python -m bench.gpu_serving ARGS.json     (written by bench_gpu.py)
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench.gpu_common import (
    GREEDY_SEED,
    SERVED_NAME,
    PhaseArgs,
    Plan,
    Record,
    child_main,
    measured,
    model_folder,
    random_prompts,
)

REPO = Path(__file__).resolve().parents[1]
_QUIET = ["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
_WORKER_LINE = re.compile(r"Worker 0: .*")
_WORKER_DTYPE = re.compile(r"Worker 0: .*?platform\), torch\.(\w+)")


# ------------------------------------------------------------------ the server
class Server:
    """One `gateway serve` in a session of its own; its process id goes to `pid_path` at
    once, so that the orchestrator can end its whole group if this phase is killed."""

    def __init__(self, folder: Path, serve_args: list[str], log_path: Path,
                 pid_path: Path) -> None:
        self.port = _free_port()
        self.command = [sys.executable, "-m", "gateway.frontend.cli.main", "serve",
                        str(folder), "--served-model-name", SERVED_NAME, *_QUIET,
                        *serve_args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path, self.pid_path = log_path, pid_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> float:
        """Start it and wait for /health; the seconds it took."""
        started = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=REPO,
                                            start_new_session=True)
        self.pid_path.write_text(str(self.process.pid))
        while time.perf_counter() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway serve exited with {self.process.returncode} "
                                   f"before it was ready:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"gateway serve was not ready after {timeout_s:.0f} s:\n"
                           f"{self.log_tail()}")

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then after `grace_s` SIGKILL to its whole group (engine core, workers)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def worker_line(self) -> str:
        match = _WORKER_LINE.search(self.log_text())
        return match.group(0) if match else "?"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------ the clients
@dataclass
class Load:
    """What a group of clients saw."""

    gaps: list[float] = field(default_factory=list)  # seconds between a stream's events
    ttfts: list[float] = field(default_factory=list)
    output_tokens: int = 0
    events: int = 0  # stream events that carried text (a token cut mid-character waits)
    completed: int = 0
    failed: int = 0
    unfinished: int = 0
    ended: float = 0.0  # time.time() when the last request ended
    errors: list[str] = field(default_factory=list)

    def add(self, other: Load) -> None:
        self.gaps += other.gaps
        self.ttfts += other.ttfts
        self.output_tokens += other.output_tokens
        self.events += other.events
        self.completed += other.completed
        self.failed += other.failed
        self.unfinished += other.unfinished
        self.ended = max(self.ended, other.ended)
        self.errors += other.errors[:3]


async def stream_completion(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                            load: Load) -> None:
    """One streamed completion; its TTFT, gaps and tokens go into `load`. A stream that
    ends short of `max_tokens` is a failure."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("error"):
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("choices"):
                times.append(time.perf_counter())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if tokens < max_tokens or not times:
        raise RuntimeError(f"{tokens} tokens in {len(times)} events, asked {max_tokens}")
    load.ttfts.append(times[0] - started)
    load.gaps += [later - earlier for earlier, later in zip(times, times[1:])]
    load.output_tokens += tokens
    load.events += len(times)
    load.completed += 1


async def drive_clients(url: str, prompts_by_client: list[list[list[int]]], max_tokens: int,
                        start_at: float, deadline: float) -> Load:
    """Each client sends its prompts one after another, all clients at once from
    `start_at` (time.time()); at `deadline` what is left is cancelled and unfinished."""
    load = Load()
    num_clients = len(prompts_by_client)
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one_client(prompts: list[list[int]]) -> None:
            for prompt in prompts:
                try:
                    await stream_completion(client, prompt, max_tokens, load)
                except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as error:
                    load.failed += 1
                    if len(load.errors) < 3:
                        load.errors.append(repr(error)[:300])

        await asyncio.sleep(max(0.0, start_at - time.time()))
        try:
            await asyncio.wait_for(asyncio.gather(*(one_client(p) for p in prompts_by_client)),
                                   timeout=max(0.1, deadline - time.time()))
        except TimeoutError:
            pass
    load.ended = min(time.time(), deadline)
    total = sum(len(p) for p in prompts_by_client)
    load.unfinished = total - load.completed - load.failed
    return load


def client_process(url: str, prompts_by_client: list[list[list[int]]], max_tokens: int,
                   start_at: float, deadline: float) -> Load:
    """A client process's work (ProcessPoolExecutor's entry)."""
    return asyncio.run(drive_clients(url, prompts_by_client, max_tokens, start_at, deadline))


def _warm_client_process(seconds: float) -> int:
    time.sleep(seconds)  # long enough that each warm-up task lands in a process of its own
    return os.getpid()


class Clients:
    """The client processes (spawned once a phase; none when one process suffices)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        num = math.ceil(max(plan.concurrencies) / plan.clients_per_process)
        self.pool: ProcessPoolExecutor | None = None
        if num > 1:
            self.pool = ProcessPoolExecutor(num, mp_context=multiprocessing.get_context("spawn"))
            for _ in range(num):
                self.pool.submit(_warm_client_process, 0.5)

    def run(self, url: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
            deadline: float) -> tuple[Load, float]:
        """`prompts` spread over `concurrency` clients; the load and the time it started."""
        per_client = [prompts[i::concurrency] for i in range(concurrency)]
        size = self.plan.clients_per_process
        groups = [per_client[i:i + size] for i in range(0, concurrency, size)]
        start_at = time.time() + (0.5 if len(groups) > 1 else 0.0)
        if len(groups) == 1 or self.pool is None:
            return client_process(url, per_client, max_tokens, start_at, deadline), start_at
        futures = [self.pool.submit(client_process, url, group, max_tokens, start_at, deadline)
                   for group in groups]
        load = Load()
        for future, group in zip(futures, groups):
            try:
                load.add(future.result(timeout=max(1.0, deadline - time.time() + 10)))
            except Exception as error:  # a client process that died or hung
                load.unfinished += sum(len(p) for p in group)
                load.errors.append(f"client process: {error!r}"[:300])
        return load, start_at

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def summarize(load: Load, started: float, concurrency: int, requests: int) -> dict[str, Any]:
    seconds = max(1e-9, load.ended - started)
    return {"concurrency": concurrency, "requests": requests, "completed": load.completed,
            "failed": load.failed, "unfinished": load.unfinished,
            "output_tokens": load.output_tokens,
            "tokens_per_event": load.output_tokens / load.events if load.events else None,
            "seconds": seconds,
            "output_tok_s": load.output_tokens / seconds,
            "itl_p50_ms": _ms(percentile(load.gaps, 50)),
            "itl_p99_ms": _ms(percentile(load.gaps, 99)),
            "ttft_p50_ms": _ms(percentile(load.ttfts, 50)),
            "ttft_p99_ms": _ms(percentile(load.ttfts, 99)), "errors": load.errors[:3]}


# ------------------------------------------------------------------ the steps
def first_request(server: Server, plan: Plan, vocab_size: int, deadline: float
                  ) -> dict[str, Any]:
    """The first request after start-up, alone: its TTFT and ITL p50."""
    one_prompt = random_prompts(1, plan.prompt_len, vocab_size, seed=999)
    started = time.time()
    load = client_process(server.url, [one_prompt], plan.output_len, started, deadline)
    if not load.completed:
        raise RuntimeError(f"the first request did not complete within "
                           f"{deadline - started:.0f} s: {load.errors}")
    return {"ttft_ms": 1000 * load.ttfts[0], "itl_p50_ms": _ms(percentile(load.gaps, 50)),
            "itl_max_ms": _ms(max(load.gaps, default=None)), "seconds": load.ended - started}


def greedy(server: Server, plan: Plan, vocab_size: int, deadline: float) -> dict[str, Any]:
    """The server's greedy tokens for the equality prompts, one request at a time."""
    prompts = random_prompts(plan.greedy_prompts, plan.greedy_prompt_len, vocab_size,
                             GREEDY_SEED)
    tokens = []
    with httpx.Client(base_url=server.url, timeout=max(1.0, deadline - time.time())) as client:
        for prompt in prompts:
            response = client.post("/v1/completions", json={
                "model": SERVED_NAME, "prompt": prompt, "max_tokens": plan.greedy_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            response.raise_for_status()
            tokens.append(response.json()["choices"][0]["token_ids"])
    return {"tokens": tokens, "dtype": served_dtype(server)}


def concurrency_level(server: Server, clients: Clients, plan: Plan, concurrency: int,
                      vocab_size: int, deadline: float) -> dict[str, Any]:
    """A warm-up of one short request per client, then the measured requests."""
    warm_deadline = time.time() + 0.2 * (deadline - time.time())
    warmup = random_prompts(concurrency, plan.prompt_len, vocab_size, seed=concurrency + 1)
    clients.run(server.url, warmup, concurrency, plan.warmup_tokens, warm_deadline)
    requests = concurrency * plan.requests_per_client[str(concurrency)]
    prompts = random_prompts(requests, plan.prompt_len, vocab_size, seed=1000 + concurrency)
    load, started = clients.run(server.url, prompts, concurrency, plan.output_len, deadline)
    summary = summarize(load, started, concurrency, requests)
    print(f"[serve] {concurrency:>4} clients: {summary['output_tok_s']:.0f} tok/s, ITL p50 "
          f"{_fmt(summary['itl_p50_ms'])} p99 {_fmt(summary['itl_p99_ms'])} ms, TTFT p50 "
          f"{_fmt(summary['ttft_p50_ms'])} ms, failed {load.failed}, unfinished "
          f"{load.unfinished}", flush=True)
    return summary


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def served_dtype(server: Server) -> str | None:
    match = _WORKER_DTYPE.search(server.log_text())
    return match.group(1) if match else None


def serve_phase(args: PhaseArgs, record: Record) -> None:
    """extra: `model`, `flags` (server flags after the plan's)."""
    plan, name = args.plan, args.extra["model"]
    vocab_size = plan.shapes[name]["vocab_size"]
    clients = Clients(plan)
    server = _start(args, record)
    try:
        # (where its figures go, its weight in the time left, the step given its deadline)
        steps: list[tuple[tuple[str, ...], float, Callable[[float], dict[str, Any]]]] = [
            (("first_request",), 1.0, partial(first_request, server, plan, vocab_size)),
            (("greedy",), 0.5, partial(greedy, server, plan, vocab_size))]
        steps += [(("levels", str(c)), 2.0,
                   partial(concurrency_level, server, clients, plan, c, vocab_size))
                  for c in plan.concurrencies]
        for index, (keys, weight, step) in enumerate(steps):
            share = weight / sum(w for _, w, _ in steps[index:])
            measured(record, keys, step, time.time() + share * _seconds_for_steps(args))
    finally:
        _stop(server, args, record)
        clients.close()


def greedy_phase(args: PhaseArgs, record: Record) -> None:
    """extra: `model`, `flags`: the greedy tokens alone (e.g. with --dtype float32)."""
    plan, name = args.plan, args.extra["model"]
    server = _start(args, record)
    try:
        measured(record, ("greedy",), greedy, server, plan, plan.shapes[name]["vocab_size"],
                 time.time() + _seconds_for_steps(args))
    finally:
        _stop(server, args, record)


def _stop_reserve_s(plan: Plan) -> float:
    return 4.0 if plan.dry_run else 8.0


def _seconds_for_steps(args: PhaseArgs) -> float:
    return max(1.0, args.seconds_left() - _stop_reserve_s(args.plan))


def _start(args: PhaseArgs, record: Record) -> Server:
    name = args.extra["model"]
    serve_args = [*args.plan.serve_args, *args.extra.get("flags", [])]
    server = Server(model_folder(args.work, name), serve_args,
                    args.out / f"server-{args.phase}.log", args.state / f"{args.phase}.pid")
    record.set("command", server.command)
    print(f"[{args.phase}] starting: {' '.join(server.command[3:])}", flush=True)
    # start-up may take most of the box: at least a quarter is left for the requests
    timeout = max(5.0, 0.75 * _seconds_for_steps(args))
    try:
        record.set("startup_s", server.start(timeout))
    except BaseException:
        server.stop(_stop_reserve_s(args.plan) / 2)
        record.set("log_tail", server.log_tail())
        raise
    record.set("worker_line", server.worker_line())
    record.set("dtype", served_dtype(server))
    print(f"[{args.phase}] ready after {record.data['startup_s']:.1f} s: "
          f"{record.data['worker_line']}", flush=True)
    return server


def _stop(server: Server, args: PhaseArgs, record: Record) -> None:
    server.stop(_stop_reserve_s(args.plan) / 2)
    text = server.log_text()
    record.set("log_errors", [line for line in text.splitlines()
                              if "Traceback" in line or " ERROR " in line][:10])


if __name__ == "__main__":
    child_main({"serve": serve_phase, "greedy": greedy_phase})

