"""End to end, against a real server of the tiny model: one request's fan-out (prompts x
`n`) is bounded (docs/reliability.md, "Prompt fan-out").

- Past --max-seqs-per-request (or --max-num-queued-reqs) a request is a 400 naming the
  field and the cap, answered at once; the repros (100,000 prompts; 500 prompts x n 16)
  included, while /health and another client's stream never wait past the loop-stall
  threshold.
- A fan-out holds at most half of --max-num-seqs in the engine: another client's stream
  starts and flows while it runs.
- A fan-out counts whole against --max-num-queued-reqs: refused with 503 when it does not
  all fit, never half-sent.
- An embedding request's inputs run in the same window (answered in order), and more of
  them than --max-num-queued-reqs is a 400 naming `input`.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.frontend.conftest import SERVED_NAME, tiny_server

pytestmark = pytest.mark.e2e

MAX_NUM_SEQS = 4  # so a request's share is 2
MAX_SEQS = 8
MAX_QUEUED = 12
LOOP_STALL_S = 0.25  # the server's --event-loop-stall-threshold (its default)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "fan-out-server.log"
    with tiny_server(tiny_model, "--max-num-seqs", str(MAX_NUM_SEQS),
                     "--max-seqs-per-request", str(MAX_SEQS),
                     "--max-num-queued-reqs", str(MAX_QUEUED), log_path=log) as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()


def _completion(**fields) -> dict:
    return {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
            **fields}


async def _stream(client: httpx.AsyncClient, max_tokens: int) -> tuple[float, float, int]:
    """Another client's streamed completion: (seconds to its first token, the longest gap
    between its events, tokens received)."""
    started = time.monotonic()
    first, gaps, tokens = None, [0.0], 0
    async with client.stream("POST", "/v1/completions", json=_completion(
            max_tokens=max_tokens, ignore_eos=True, stream=True,
            stream_options={"include_usage": True})) as response:
        assert response.status_code == 200
        last = started
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if first is None:
                first = now - started
            else:
                gaps.append(now - last)
            last = now
            usage = json.loads(line[6:])["usage"]
            tokens = usage["completion_tokens"] if usage else tokens
    assert first is not None
    return first, max(gaps), tokens


async def _health(client: httpx.AsyncClient, done: asyncio.Event) -> list[float]:
    latencies = []
    while not done.is_set():
        started = time.monotonic()
        assert (await client.get("/health")).status_code == 200
        latencies.append(time.monotonic() - started)
        await asyncio.sleep(0.05)
    return latencies


async def _while_served(server, hostile, stream_tokens: int = 60):
    """Run `hostile(client)` while /health is probed and another client streams;
    (its result, the health latencies, the stream's (first token s, longest gap s, tokens))."""
    async with httpx.AsyncClient(base_url=server.url(), timeout=120) as client, \
            httpx.AsyncClient(base_url=server.url(), timeout=120) as other:
        await other.get("/health")  # connections ready before the clocks start
        await client.get("/health")
        done = asyncio.Event()
        health = asyncio.create_task(_health(other, done))
        hostile_task = asyncio.create_task(hostile(client))
        await asyncio.sleep(0.2)
        stream = await _stream(other, stream_tokens)
        result = await hostile_task
        done.set()
        return result, await health, stream


def _assert_served(health: list[float], stream: tuple[float, float, int], tokens: int) -> None:
    assert health and max(health) < LOOP_STALL_S, sorted(health)[-5:]
    first_s, gap_s, received = stream
    assert received == tokens
    assert first_s < LOOP_STALL_S and gap_s < LOOP_STALL_S, stream


@pytest.mark.parametrize(("body", "param", "asked"), [
    (_completion(prompt=["a"] * 100_000, max_tokens=1), "prompt", "100000 prompt(s) x n 1"),
    (_completion(prompt=["a"] * 500, n=16, max_tokens=1), "prompt", "500 prompt(s) x n 16"),
    (_completion(prompt=[[1, 2]] * 2, n=8), "n", "2 prompt(s) x n 8"),
])
def test_a_fan_out_past_the_cap_is_a_400_at_once_while_the_server_serves(server, body, param,
                                                                        asked):
    async def hostile(client):
        started = time.monotonic()
        response = await client.post("/v1/completions", json=body)
        return response, time.monotonic() - started

    (response, seconds), health, stream = asyncio.run(_while_served(server, hostile))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert asked in error["message"] and f"--max-seqs-per-request {MAX_SEQS}" in \
        error["message"], error
    assert seconds < 2.0
    _assert_served(health, stream, 60)
    assert "event loop was blocked" not in server.log_text()


def test_chat_n_past_the_cap_is_a_400_naming_n(server):
    response = httpx.post(server.url("/v1/chat/completions"), timeout=60, json={
        "model": SERVED_NAME, "n": MAX_SEQS + 1, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"


@pytest.mark.parametrize("stream", [False, True])
def test_a_fan_out_does_not_starve_another_client(server, stream):
    """8 sequences of 100 tokens on a batch of 4: the fan-out runs two at a time, so the
    other client's stream starts at once and flows (FCFS alone made it wait for four)."""
    max_tokens = 100

    async def fan_out(client):
        body = _completion(prompt=["Once", "upon"], n=4, max_tokens=max_tokens,
                           ignore_eos=True, stream=stream, temperature=1.0, seed=1,
                           **({"stream_options": {"include_usage": True}} if stream else {}))
        if not stream:
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            answer = response.json()
            return len(answer["choices"]), answer["usage"]["completion_tokens"]
        texts: dict[int, int] = {}
        usage = None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    for choice in chunk["choices"]:
                        texts[choice["index"]] = texts.get(choice["index"], 0) + 1
                    if chunk["usage"]:
                        usage = chunk["usage"]["completion_tokens"]
        return len(texts), usage

    (num_choices, tokens), health, other = asyncio.run(_while_served(server, fan_out, 20))
    assert num_choices == MAX_SEQS
    assert tokens == MAX_SEQS * max_tokens
    _assert_served(health, other, 20)


def test_a_fan_out_counts_whole_against_the_queue_cap(server):
    """Two streamed fan-outs of 4 hold 8 places (2 sequences of each in the engine, 2
    held back); one of 6 more does not fit the 12 and is refused whole; one of 4 fits."""
    async def run():
        async with httpx.AsyncClient(base_url=server.url(), timeout=120) as client:
            async def hold(ready: asyncio.Event, release: asyncio.Event):
                async with client.stream("POST", "/v1/completions", json=_completion(
                        prompt=["a", "b"], n=2, max_tokens=1500, ignore_eos=True,
                        stream=True)) as response:
                    async for _ in response.aiter_lines():
                        ready.set()
                        if release.is_set():
                            return  # closing the stream aborts it

            release = asyncio.Event()
            readies = [asyncio.Event() for _ in range(2)]
            holders = [asyncio.create_task(hold(r, release)) for r in readies]
            for ready in readies:
                await asyncio.wait_for(ready.wait(), 60)
            load = (await client.get("/load")).json()["server_load"]
            refused = await client.post("/v1/completions", json=_completion(
                prompt=["a", "b"], n=3))
            admitted = asyncio.create_task(client.post("/v1/completions", json=_completion(
                prompt=["a"] * 4, max_tokens=2)))
            await asyncio.sleep(0.2)
            release.set()
            await asyncio.gather(*holders)
            return load, refused, await admitted

    load, refused, admitted = asyncio.run(run())
    assert load == 4  # the sequences in the engine; the 4 held back count for admission
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and "needs 6" in error["message"], error
    assert "has 8 requests queued or running" in error["message"], error
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert admitted.status_code == 200, admitted.text
    assert len(admitted.json()["choices"]) == 4
    deadline = time.monotonic() + 10
    while httpx.get(server.url("/load")).json()["server_load"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


# ------------------------------------------------------------------ pooling fan-out
@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    """The embedding default model, with the same batch and queue caps."""
    from tests.plugin_dists import subprocess_env
    from tests.server import ServerProcess

    environment = subprocess_env()
    environment.pop("VLLM_API_KEY", None)
    log = tmp_path_factory.mktemp("logs") / "fan-out-embed-server.log"
    with ServerProcess(["all-MiniLM-L6-v2", "--disable-uvicorn-access-log",
                        "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--max-num-queued-reqs", str(MAX_SEQS)],
                       env=environment, log_path=log) as server:
        yield server


def test_embedding_inputs_run_in_the_window_and_answer_in_order(embed_server):
    texts = [f"sentence number {i} is about {word}" for i, word in
             enumerate(["cats", "dogs", "ships", "rain", "tea", "maps", "jazz", "moss"])]
    url = embed_server.url("/v1/embeddings")
    together = httpx.post(url, timeout=60, json={"input": texts})
    assert together.status_code == 200, together.text
    data = together.json()["data"]
    assert [item["index"] for item in data] == list(range(len(texts)))
    for text, item in zip(texts, data):
        alone = httpx.post(url, timeout=60, json={"input": text}).json()["data"][0]
        assert item["embedding"] == pytest.approx(alone["embedding"], abs=1e-5)


def test_more_embedding_inputs_than_the_queue_cap_is_a_400_naming_it(embed_server):
    response = httpx.post(embed_server.url("/v1/embeddings"), timeout=60,
                          json={"input": ["a"] * (MAX_SEQS + 1)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input"
    assert f"--max-num-queued-reqs {MAX_SEQS}" in error["message"], error
