"""End to end, against real servers of the tiny model: the work one hostile request can make
the server do is bounded (docs/reliability.md, "Bounded work per request").

- Grammars: a grammar that compiles past --structured-outputs-compile-timeout is a 400 and
  its compile is stopped (logged, counted in /metrics) while /health, a concurrent request
  and a trivial grammar request are served; abandoned hostile requests stop their
  compiles; constraints past the size caps are refused before they reach the engine; JSON
  text nested 3,000 deep is a 400, not a 500.
- Special tokens typed in any field the chat template renders stay text.
- A request's own chat template: 'x' * 10**9 is refused without being made, and a loop of
  10**10 is stopped at --chat-template-render-timeout while the server serves.

Each hostile case checks that the server tree's memory (proportional set size, so pages
the helpers share are counted once) is back within a stated margin afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.engine.test_grammar_bounds import hostile_grammar
from tests.frontend.chat_templates import (
    EVERY_FIELD_TEMPLATE,
    FIELDS,
    NUM_IM_END,
    NUM_IM_START,
    every_field,
)
from tests.frontend.conftest import SERVED_NAME, tiny_server
from tests.server import descendant_pids

pytestmark = pytest.mark.e2e

COMPILE_TIMEOUT_S = 1.0
RENDER_TIMEOUT_S = 2.0
LOOP_STALL_S = 0.25  # the server's --event-loop-stall-threshold
TRIVIAL_WITHIN_S = 5.0  # a trivial grammar while a hostile one compiles
#: The server tree's memory after a hostile request, against before it (MiB): a killed
#: helper is replaced by a fresh one of the same size.
MEMORY_MARGIN_MIB = 64
HUGE_REPEAT = "{{ 'x' * 1000000000 }}"
ENDLESS_LOOP = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                "{% endfor %}{{ messages[0].content }}")


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("templates") / "every_field.jinja"
    path.write_text(EVERY_FIELD_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(tiny_model, template_file, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "bounded-server.log"
    with tiny_server(tiny_model, "--structured-outputs-compile-timeout",
                     str(COMPILE_TIMEOUT_S), "--trust-request-chat-template",
                     "--chat-template-render-timeout", str(RENDER_TIMEOUT_S),
                     "--chat-template", str(template_file), log_path=log) as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()
    assert not server.leftover_pids


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from gateway.tokenizer import load_tokenizer
    return load_tokenizer(tiny_model)


# ------------------------------------------------------------------ helpers
def _tree(server) -> list[int]:
    return [server.process.pid, *descendant_pids(server.process.pid)]


def _pss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        total += int(re.search(r"^Pss:\s+(\d+) kB", rollup, re.MULTILINE).group(1))
    return total / 1024


def _cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _helpers(server, of: str) -> list[int]:
    """The helper processes of the front end ("front end": chat templates) or of the
    engine core ("engine": grammar trials): children of that process's fork server."""
    pids = _tree(server)
    servers = {pid for pid in pids if b"forkserver" in _cmdline(pid)
               and (_parent(pid) == server.process.pid) == (of == "front end")}
    return [pid for pid in pids if _parent(pid) in servers]


def _wait_quiet(server, of: str, within_s: float = 300.0) -> None:
    """Until the two helpers of `of` exist and the tree uses (almost) no CPU for half a
    second: the helpers started, no compile or render runs."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        before = _cpu_s(_tree(server))
        time.sleep(0.5)
        if len(_helpers(server, of)) >= 2 and _cpu_s(_tree(server)) - before < 0.1:
            return
    raise AssertionError(f"the server did not settle: {of} helpers {_helpers(server, of)}")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _sample(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url("/metrics"), timeout=30).text
    pattern = re.escape(name) + (r"\{[^}]*" + re.escape(labels) + r"[^}]*\}" if labels else "")
    values = [float(m.group(1)) for m in
              re.finditer(r"^" + pattern + r"(?:\{[^}]*\})?\s+(\S+)$", text, re.MULTILINE)]
    return sum(values)


def _chat(**fields) -> dict:
    return {"model": SERVED_NAME, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}], **fields}


async def _probe(client: httpx.AsyncClient, done: asyncio.Event) -> dict[str, list[float]]:
    """While `done` is not set, every 100 ms: GET /health and POST /tokenize of chat
    messages (the server's template rendered, the prompt tokenized); their latencies."""
    latencies: dict[str, list[float]] = {"health": [], "tokenize": []}
    while not done.is_set():
        for name, call in (("health", client.get("/health")),
                           ("tokenize", client.post("/tokenize", json={
                               "model": SERVED_NAME,
                               "messages": [{"role": "user", "content": "hi"}]}))):
            started = time.monotonic()
            response = await call
            assert response.status_code == 200, response.text
            latencies[name].append(time.monotonic() - started)
        await asyncio.sleep(0.1)
    return latencies


async def _while_probed(server, hostile):
    """Run `hostile(client)` while probing the server; (its result, the latencies)."""
    async with httpx.AsyncClient(base_url=server.url(), timeout=120) as client:
        await client.get("/health")  # a connection ready before the clock starts
        done = asyncio.Event()
        probe = asyncio.create_task(_probe(client, done))
        await asyncio.sleep(0.3)
        try:
            result = await hostile(client)
        finally:
            done.set()
        return result, await probe


def _assert_served(latencies: dict[str, list[float]]) -> None:
    for name, values in latencies.items():
        assert values, name
        assert max(values) < LOOP_STALL_S, (name, sorted(values)[-5:])


# ------------------------------------------------------------------ grammars
def test_a_hostile_grammar_is_stopped_at_the_limit_while_the_server_serves(server):
    warm = httpx.post(server.url("/v1/chat/completions"), timeout=300, json=_chat(
        structured_outputs={"choice": ["warm", "up"]}))
    assert warm.status_code == 200, warm.text
    _wait_quiet(server, "engine")
    memory_before = _pss_mib(_tree(server))
    timeouts_before = _sample(server, "gateway_grammar_compiles_total", 'outcome="timeout"')
    slow_before = _sample(server, "gateway_grammar_slow_compiles_total")

    async def hostile(client):
        grammar = client.post("/v1/chat/completions", json=_chat(
            structured_outputs={"grammar": hostile_grammar()}))
        task = asyncio.ensure_future(grammar)
        await asyncio.sleep(0.3)  # its compile is under way
        started = time.monotonic()
        trivial = await client.post("/v1/chat/completions", json=_chat(
            structured_outputs={"choice": ["yes", "no"]}))
        return await task, trivial, time.monotonic() - started

    (refused, trivial, trivial_s), latencies = asyncio.run(_while_probed(server, hostile))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "structured_outputs.grammar"
    assert "--structured-outputs-compile-timeout" in error["message"]
    assert trivial.status_code == 200 and trivial_s < TRIVIAL_WITHIN_S, (trivial_s, trivial)
    _assert_served(latencies)
    assert re.search(r"Grammar refused: request \S+ \(structured_outputs.grammar\) was still "
                     r"compiling after [0-9.]+ s", server.log_text())
    assert _sample(server, "gateway_grammar_compiles_total", 'outcome="timeout"') == \
        timeouts_before + 1
    assert _sample(server, "gateway_grammar_slow_compiles_total") >= slow_before + 1
    _wait_quiet(server, "engine")
    assert _pss_mib(_tree(server)) - memory_before < MEMORY_MARGIN_MIB


def test_constraints_past_the_caps_are_refused_at_once_and_leave_nothing(server):
    """The repros: a 100,000-value enum (45 s, 420 MiB to compile), and 24 distinct
    20,000-value enums (the engine grew by 1.7 GB); both refused by the front end now."""
    memory_before = _pss_mib(_tree(server))
    schemas = [{"type": "object", "properties": {"v": {"enum": list(range(100_000))}}}]
    schemas += [{"type": "object", "properties": {f"v{i}": {"enum": [
        f"{i}-{j}" for j in range(20_000)]}}} for i in range(24)]
    for schema in schemas:
        started = time.monotonic()
        response = httpx.post(server.url("/v1/chat/completions"), timeout=60, json=_chat(
            structured_outputs={"json": schema}))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "structured_outputs.json"
        assert "--structured-outputs-max-enum-values" in error["message"]
        assert time.monotonic() - started < 1.0
    assert _pss_mib(_tree(server)) - memory_before < MEMORY_MARGIN_MIB


@pytest.mark.parametrize("field,value", [
    ("structured_outputs", {"json": "[" * 3000 + "]" * 3000}),
    ("guided_json", "{" * 3000),
    ("guided_json", "not json"),
])
def test_schema_text_too_deep_or_not_json_is_a_400_naming_the_field(server, field, value):
    response = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                          json=_chat(**{field: value}))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in (field, f"{field}.json")
    assert "RecursionError" not in server.log_text()


# ------------------------------------------------------------------ special tokens
@pytest.mark.parametrize("source", ["server", "request"])
@pytest.mark.parametrize("field", FIELDS)
def test_special_tokens_typed_in_any_field_stay_text(server, tokenizer, field, source):
    body = _chat(**every_field(field), tool_choice="none", return_token_ids=True)
    if source == "request":
        body["chat_template"] = EVERY_FIELD_TEMPLATE
    response = httpx.post(server.url("/v1/chat/completions"), timeout=60, json=body)
    assert response.status_code == 200, response.text
    ids = response.json()["prompt_token_ids"]
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    specials = [i for i in ids if i in set(tokenizer.all_special_ids)]
    assert (specials.count(start), specials.count(end)) == (NUM_IM_START, NUM_IM_END)
    assert len(specials) == NUM_IM_START + NUM_IM_END


# ------------------------------------------------------------------ request templates
def test_a_huge_repetition_in_a_request_template_is_refused_without_being_made(server):
    def front_end_peak_mib() -> float:
        status = Path(f"/proc/{server.process.pid}/status").read_text()
        return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE).group(1)) / 1024

    memory_before, peak_before = _pss_mib(_tree(server)), front_end_peak_mib()
    started = time.monotonic()
    response = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                          json=_chat(chat_template=HUGE_REPEAT))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template"
    assert "characters" in response.json()["error"]["message"]
    assert time.monotonic() - started < 2.0
    assert front_end_peak_mib() - peak_before < 50  # never allocated (was 12.8 GB)
    assert _pss_mib(_tree(server)) - memory_before < MEMORY_MARGIN_MIB


def test_an_endless_request_template_is_stopped_at_its_limit_while_the_server_serves(server):
    httpx.post(server.url("/v1/chat/completions"), timeout=120,
               json=_chat(chat_template="{{ messages[0].content }}"))  # helpers started
    _wait_quiet(server, "front end")
    memory_before = _pss_mib(_tree(server))

    async def hostile(client):
        started = time.monotonic()
        responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=_chat(
            chat_template=ENDLESS_LOOP)) for _ in range(2)))
        return responses, time.monotonic() - started

    (responses, seconds), latencies = asyncio.run(_while_probed(server, hostile))
    for response in responses:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "chat_template"
        assert "--chat-template-render-timeout" in error["message"]
    assert seconds < RENDER_TIMEOUT_S + 3.0
    _assert_served(latencies)
    # Nothing keeps running for the abandoned renders: the tree goes quiet at once.
    _wait_quiet(server, "front end", within_s=10.0)
    assert _pss_mib(_tree(server)) - memory_before < MEMORY_MARGIN_MIB


# ------------------------------------------------------------------ abandoned compiles
@pytest.fixture(scope="module")
def patient_server(tiny_model, tmp_path_factory):
    """A server whose compile limit is far away: only an abort stops a compile."""
    log = tmp_path_factory.mktemp("logs") / "patient-server.log"
    with tiny_server(tiny_model, "--structured-outputs-compile-timeout", "120",
                     log_path=log) as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()


def test_abandoned_hostile_requests_stop_their_compiles(patient_server):
    """The repro: four requests abandoned after a while kept compiling, and the next
    trivial grammar request waited 48 s."""
    server = patient_server
    warm = httpx.post(server.url("/v1/chat/completions"), timeout=300, json=_chat(
        structured_outputs={"choice": ["warm", "up"]}))
    assert warm.status_code == 200, warm.text
    _wait_quiet(server, "engine")
    memory_before = _pss_mib(_tree(server))

    async def abandon(client, number):
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", timeout=1.0, json=_chat(
                structured_outputs={"grammar": hostile_grammar() + " " * number}))

    async def run():
        async with httpx.AsyncClient(base_url=server.url(), timeout=60) as client:
            await asyncio.gather(*(abandon(client, i) for i in range(4)))
            started = time.monotonic()
            trivial = await client.post("/v1/chat/completions", json=_chat(
                structured_outputs={"choice": ["yes", "no"]}))
            return trivial, time.monotonic() - started

    trivial, seconds = asyncio.run(run())
    assert trivial.status_code == 200 and seconds < TRIVIAL_WITHIN_S, (seconds, trivial.text)
    _wait_quiet(server, "engine", within_s=10.0)  # no compile runs on
    assert _pss_mib(_tree(server)) - memory_before < MEMORY_MARGIN_MIB
    assert json.loads(httpx.get(server.url("/load"), timeout=10).text)["server_load"] == 0
