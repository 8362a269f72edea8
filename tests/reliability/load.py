"""A bounded load driver for a running `gateway serve` (shared by tests/reliability/test_load.py
and bench/bench_load.py).

`run_load(base_url, model, n, concurrency)` sends `n` requests, at most `concurrency` in
flight, cycling through a fixed mix (`MIX`): completions and chat completions, streamed and
whole, /tokenize, the example `server_info` plugin's GET /v1/server-info, and GET /metrics.
Every answer is checked for completeness and shape (`check_*`): status 200, a stream ends
with `data: [DONE]`, usage present and consistent. Generation asks for `ignore_eos` and a
`max_tokens` (fixed, or per request with `shape=varied_shapes()`: mixed prompt lengths and
max_tokens), so every completion must have exactly `max_tokens` tokens and finish with
"length"; a stream with `continuous_usage_stats` must count up by at least one token per
content chunk to that same figure. A failed check is recorded (not raised), so one run reports
every fault it met; `LoadResult.faults` lists them.

`server_rss_bytes(pid)`: resident memory of a server and every process it started, from /proc.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.server import descendant_pids

PROMPTS = ["The quick brown fox", "Hello, world! This is", "Once upon a time there was",
           "Plugins extend the gateway", "0123456789 + - * /"]

#: Request i's (prompt, max_tokens).
Shape = Callable[[int], tuple[str, int]]


def fixed_shapes(max_tokens: int) -> Shape:
    """Short prompts (a few tokens) and the same max_tokens for every request."""
    return lambda index: (f"{PROMPTS[index % len(PROMPTS)]} #{index}", max_tokens)


_WORDS = ("the of and to in is was for on are with as by at from that this be or have not "
          "they which one you were all we when there can an their has more if no so said what "
          "up its about into than them only other new some could time these two may first "
          "then do any like my now over such our man me even most made after also did many "
          "before must through back years where much your way well down should because each "
          "just those people how too little state good very make world still own see men work "
          "long get here between both life being under never day same another know while").split()
#: Prompt lengths in words and max_tokens of a varied run: most requests short, some long,
#: as traffic is. 700 words (about 900 tokens of the default model) + 192 tokens fit a
#: 2,048-token context.
PROMPT_WORDS = (3, 8, 20, 60, 150, 400, 700)
PROMPT_WEIGHTS = (20, 20, 20, 15, 12, 8, 5)
MAX_TOKENS = (2, 8, 24, 64, 128, 192)
MAX_TOKENS_WEIGHTS = (15, 25, 25, 18, 10, 7)


def varied_shapes(seed: int = 0, max_words: int = PROMPT_WORDS[-1]) -> Shape:
    """Mixed prompt lengths (up to `max_words` words) and max_tokens, the same for index i
    in every run; each prompt differs from its first word (no prefix shared)."""
    lengths = [(words, weight) for words, weight in zip(PROMPT_WORDS, PROMPT_WEIGHTS)
               if words <= max_words]

    def shape(index: int) -> tuple[str, int]:
        rng = random.Random(seed * 1_000_003 + index)
        words = rng.choices([w for w, _ in lengths], [weight for _, weight in lengths])[0]
        text = " ".join(rng.choice(_WORDS) for _ in range(words))
        return f"{index}: {text}", rng.choices(MAX_TOKENS, MAX_TOKENS_WEIGHTS)[0]
    return shape


def peak_shapes(max_words: int = PROMPT_WORDS[-1]) -> Shape:
    """The largest request of the varied mix, every time: the longest prompt and the most
    tokens (a warm-up that reaches the largest batches and contexts first)."""
    longest = max(words for words in PROMPT_WORDS if words <= max_words)
    return lambda index: (f"{index}: " + " ".join(_WORDS[(index + i) % len(_WORDS)]
                                                  for i in range(longest)), MAX_TOKENS[-1])


class CheckFailed(Exception):
    """An answer that is not complete and well-formed."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass
class LoadResult:
    sent: int = 0
    answered: int = 0
    elapsed_s: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    faults: list[str] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    generated: int = 0  # requests that went through the engine
    generated_tokens: int = 0

    @property
    def requests_per_s(self) -> float:
        return self.answered / self.elapsed_s if self.elapsed_s else 0.0

    def percentiles(self) -> dict[str, tuple[int, float, float]]:
        """Per kind: (count, p50 s, p99 s)."""
        out = {}
        for kind, values in sorted(self.latencies.items()):
            ordered = sorted(values)
            p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
            out[kind] = (len(ordered), statistics.median(ordered), p99)
        return out


# ------------------------------------------------------------------ the requests
def _sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    events = []
    for block in text.split("\n\n"):
        block = block.strip("\n")
        if not block:
            continue
        _expect(block.startswith("data: "), f"SSE block without data: {block[:80]!r}")
        events.append(block[len("data: "):])
    return events


def _check_stream(text: str, *, chat: bool, max_tokens: int, include_usage: bool,
                  continuous: bool) -> int:
    """Check a streamed completion; return its completion token count."""
    events = _sse_events(text)
    _expect(bool(events) and events[-1] == "[DONE]", "stream does not end with data: [DONE]")
    _expect(events.count("[DONE]") == 1, "more than one [DONE]")
    chunks = [json.loads(e) for e in events[:-1]]
    _expect(bool(chunks), "stream without chunks")
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
              and c["choices"][0].get("finish_reason") is not None]
    _expect(finish == ["length"], f"finish reasons {finish} (want one 'length')")
    content_chunks, last_count = 0, 0
    for chunk in chunks:
        _expect(chunk["object"] == ("chat.completion.chunk" if chat else "text_completion"),
                f"chunk object {chunk.get('object')!r}")
        if not chunk["choices"]:
            continue
        choice = chunk["choices"][0]
        piece = choice["delta"].get("content") if chat else choice["text"]
        if piece:
            content_chunks += 1
        if continuous and (piece or choice.get("finish_reason")):
            count = chunk["usage"]["completion_tokens"]
            _expect(count > last_count, f"continuous usage did not count up: {last_count} "
                                        f"then {count}")
            last_count = count
    if not include_usage:
        _expect(all("usage" not in c or c["usage"] is None for c in chunks),
                "usage sent without include_usage")
        return max_tokens
    usage_chunks = [c for c in chunks if not c["choices"]]
    _expect(len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0],
            "include_usage: want exactly one final usage chunk with no choices")
    usage = usage_chunks[0]["usage"]
    _expect(usage["completion_tokens"] == max_tokens,
            f"stream usage completion_tokens {usage['completion_tokens']} != {max_tokens}")
    _expect(usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"],
            "usage total != prompt + completion")
    _expect(content_chunks <= usage["completion_tokens"],
            f"{content_chunks} content chunks for {usage['completion_tokens']} tokens")
    if continuous:
        _expect(last_count == usage["completion_tokens"],
                f"tokens received {last_count} != final usage {usage['completion_tokens']}")
    return int(usage["completion_tokens"])


def _check_whole(body: dict[str, Any], *, chat: bool, max_tokens: int) -> int:
    _expect(body["object"] == ("chat.completion" if chat else "text_completion"),
            f"object {body.get('object')!r}")
    _expect(len(body["choices"]) == 1, "want one choice")
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    _expect(isinstance(text, str), "no text")
    _expect(choice["finish_reason"] == "length", f"finish_reason {choice['finish_reason']!r}")
    usage = body.get("usage")
    _expect(usage is not None, "no usage")
    _expect(usage["completion_tokens"] == max_tokens,
            f"usage completion_tokens {usage['completion_tokens']} != {max_tokens}")
    _expect(usage["prompt_tokens"] > 0, "usage prompt_tokens 0")
    _expect(usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"],
            "usage total != prompt + completion")
    return int(usage["completion_tokens"])


@dataclass(frozen=True)
class Kind:
    name: str
    method: str
    path: str
    generates: bool = False
    chat: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous: bool = False


MIX: tuple[Kind, ...] = (
    Kind("completion", "POST", "/v1/completions", generates=True),
    Kind("completion_stream", "POST", "/v1/completions", generates=True, stream=True,
         include_usage=True),
    Kind("chat", "POST", "/v1/chat/completions", generates=True, chat=True),
    Kind("chat_stream", "POST", "/v1/chat/completions", generates=True, chat=True,
         stream=True, include_usage=True),
    Kind("completion_stream_continuous", "POST", "/v1/completions", generates=True,
         stream=True, include_usage=True, continuous=True),
    Kind("chat_stream_plain", "POST", "/v1/chat/completions", generates=True, chat=True,
         stream=True),
    Kind("tokenize", "POST", "/tokenize"),
    Kind("server_info", "GET", "/v1/server-info"),
    Kind("metrics", "GET", "/metrics"),
)


def _body(kind: Kind, prompt: str, model: str, max_tokens: int) -> dict[str, Any] | None:
    if kind.name == "tokenize":
        return {"model": model, "prompt": prompt}
    if not kind.generates:
        return None
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                            "stream": kind.stream}
    if kind.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if kind.include_usage:
        body["stream_options"] = {"include_usage": True,
                                  "continuous_usage_stats": kind.continuous}
    return body


def _check(kind: Kind, response: httpx.Response, max_tokens: int) -> int:
    """Check one answer; return the completion tokens it carried (0 if it generates none)."""
    _expect(response.status_code == 200,
            f"status {response.status_code}: {response.text[:200]!r}")
    _expect(bool(response.headers.get("x-request-id")), "no X-Request-Id")
    if kind.stream:
        _expect(response.headers["content-type"].startswith("text/event-stream"),
                "stream without text/event-stream")
        return _check_stream(response.text, chat=kind.chat, max_tokens=max_tokens,
                             include_usage=kind.include_usage, continuous=kind.continuous)
    if kind.generates:
        return _check_whole(response.json(), chat=kind.chat, max_tokens=max_tokens)
    if kind.name == "tokenize":
        body = response.json()
        _expect(body["count"] == len(body["tokens"]) > 0, "tokenize count/tokens mismatch")
    elif kind.name == "server_info":
        body = response.json()
        _expect(body["engine"]["alive"] is True, "server-info: engine not alive")
    elif kind.name == "metrics":
        _expect("vllm:request_success_total" in response.text, "metrics without counters")
    return 0


async def run_load(base_url: str, model: str, n: int, concurrency: int, *,
                   max_tokens: int = 8, shape: Shape | None = None, first_index: int = 0,
                   mix: tuple[Kind, ...] = MIX, timeout_s: float = 120.0,
                   on_progress: Callable[[int], Awaitable[None]] | None = None) -> LoadResult:
    """Send `n` requests (request i is `mix[i % len(mix)]`, its prompt and max_tokens
    `shape(i)`, by default `fixed_shapes(max_tokens)`; i from `first_index`), `concurrency`
    at a time, and check every answer (see the module docstring)."""
    shape = shape or fixed_shapes(max_tokens)
    result = LoadResult()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(first_index, first_index + n):
        queue.put_nowait(index)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                index = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            kind = mix[index % len(mix)]
            prompt, tokens_asked = shape(index)
            result.sent += 1
            started = time.perf_counter()
            try:
                response = await client.request(kind.method, kind.path,
                                                json=_body(kind, prompt, model, tokens_asked))
            except httpx.HTTPError as exc:
                result.faults.append(f"#{index} {kind.name}: no answer: {exc!r}")
                continue
            result.latencies[kind.name].append(time.perf_counter() - started)
            result.answered += 1
            result.statuses[response.status_code] += 1
            try:
                tokens = _check(kind, response, tokens_asked)
            except (CheckFailed, KeyError, TypeError, ValueError, IndexError) as exc:
                result.faults.append(f"#{index} {kind.name}: {exc!r}")
                continue
            if kind.generates:
                result.generated += 1
                result.generated_tokens += tokens
            if on_progress is not None:
                await on_progress(result.answered)

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s,
                                 limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        result.elapsed_s = time.perf_counter() - started
    return result


# ------------------------------------------------------------------ memory
def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0  # exited, or a kernel thread


def server_rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` and every process below it, summed."""
    return sum(_rss_bytes(p) for p in {pid, *descendant_pids(pid)})


def server_rss_by_process(pid: int) -> dict[int, int]:
    return {p: _rss_bytes(p) for p in sorted({pid, *descendant_pids(pid)})}
