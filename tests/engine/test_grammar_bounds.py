"""Grammar compilation is bounded in the engine core, driven in-process on the tiny random
model: a grammar past the time or memory limit is refused and its trial helper killed, an
aborted request's compilation is stopped, a trivial grammar never waits behind a hostile
one, and the compiled-grammar cache is bounded in bytes."""

from __future__ import annotations

import json
import logging
import time

import pytest

from gateway.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from gateway.engine.core import EngineCore
from gateway.engine.structured_output.manager import GrammarCache
from gateway.messages import EngineCoreRequest
from gateway.sampling_params import SamplingParams
from gateway.structured_outputs_params import StructuredOutputsParams
from gateway.tokenizer import load_tokenizer
from tests.server import is_alive


def hostile_grammar(num_rules: int = 180) -> str:
    """A grammar of a few KiB that xgrammar takes long to compile, growing faster than its
    size: with the tiny model's 512-token vocabulary, 130 rules took 4.3 s and 280 rules
    90 s on a loaded 2-core box (with a 49,152-token vocabulary, 40 rules took 13.8 s).
    Every size cap of the front end lets it through: only the time limit stops it."""
    return "root ::= " + " ".join(f"[a-z]{{0,{k}}}" for k in range(20, 20 + num_rules))


HOSTILE_GRAMMAR = hostile_grammar()
TIME_LIMIT_S = 1.0
#: A trivial grammar's compile, with a free helper and thread: milliseconds. The bound
#: leaves room for a loaded machine.
TRIVIAL_WITHIN_S = 5.0


def _engine(model, timeout_s):
    config = EngineConfig(model=ModelConfig(model=str(model), dtype="float32"),
                          cache=CacheConfig(kv_cache_memory_gib=0.02),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
                          structured_outputs=StructuredOutputsConfig(compile_timeout_s=timeout_s))
    return EngineCore(config)


@pytest.fixture(scope="module")
def core(tiny_llama):
    engine = _engine(tiny_llama, TIME_LIMIT_S)
    _warm(engine, load_tokenizer(tiny_llama))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


def _warm(engine, tokenizer):
    """Compile a trivial grammar, so both trial helpers have started (a helper's start-up
    is never counted against the limit, but it would be against these tests' clocks)."""
    _run_until_done(engine, tokenizer, {f"warm-{i}": _choice([f"w{i}", "x"]) for i in range(2)})
    deadline = time.monotonic() + 300
    while engine.structured._trials.num_idle() < 2 and time.monotonic() < deadline:
        time.sleep(0.1)


def _choice(choices):
    return SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=(
        StructuredOutputsParams(choice=choices, source_param="structured_outputs.choice")))


def _grammar(text):
    return SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=(
        StructuredOutputsParams(grammar=text, source_param="structured_outputs.grammar")))


def _add(engine, tokenizer, request_id, params):
    assert engine.add_request(EngineCoreRequest(request_id, tokenizer.encode("Hi"), params,
                                                time.time())) is None


def _run_until_done(engine, tokenizer, requests, within_s=120.0, compiles=None):
    """{request id: (finished after s, the finishing output)}; the grammar compilations'
    stats the steps report are added to `compiles`."""
    started = time.monotonic()
    for request_id, params in requests.items():
        _add(engine, tokenizer, request_id, params)
    done = {}
    while engine.has_work() and time.monotonic() - started < within_s:
        outputs = engine.step()
        if outputs.iteration_stats is not None and compiles is not None:
            compiles += outputs.iteration_stats.grammar_compiles
        for output in outputs.outputs:
            if output.finish_reason is not None:
                done[output.request_id] = (time.monotonic() - started, output)
    return done


def test_a_grammar_past_the_time_limit_is_refused_naming_its_field_and_limit(core, tokenizer):
    helpers_before = set(core.structured._trials.pids())
    compiles = []
    done = _run_until_done(core, tokenizer, {"hostile": _grammar(HOSTILE_GRAMMAR)},
                           compiles=compiles)
    seconds, output = done["hostile"]
    assert output.finish_reason == "error" and output.error_kind == "invalid_request"
    assert output.error_param == "structured_outputs.grammar"
    assert "more than 1 s" in output.error and "--structured-outputs-compile-timeout" in \
        output.error
    assert seconds < TIME_LIMIT_S + 3.0  # stopped at the limit, not at the compile's end
    assert [s.outcome for s in compiles] == ["timeout"]
    assert TIME_LIMIT_S <= compiles[0].seconds < TIME_LIMIT_S + 1.0
    assert any(not is_alive(pid) for pid in helpers_before)  # its helper was killed
    assert ("grammar", HOSTILE_GRAMMAR, False) not in core.structured.grammars


def test_a_trivial_grammar_does_not_wait_behind_a_hostile_compile(core, tokenizer):
    _warm(core, tokenizer)  # the helper the last test killed is back
    _add(core, tokenizer, "hostile", _grammar(HOSTILE_GRAMMAR + " "))  # not in any cache
    time.sleep(0.2)  # the hostile grammar is compiling in a helper
    done = _run_until_done(core, tokenizer, {"trivial": _choice(["yes", "no"])})
    trivial_s, trivial = done["trivial"]
    assert trivial.finish_reason == "stop" and trivial_s < TRIVIAL_WITHIN_S
    assert done["hostile"][1].error_kind == "invalid_request"  # stopped at its limit after


def test_an_aborted_request_stops_its_compilation_and_keeps_nothing(tiny_llama, tokenizer):
    engine = _engine(tiny_llama, 120.0)  # a limit far away: only the abort stops it
    try:
        _warm(engine, tokenizer)
        helpers = set(engine.structured._trials.pids())
        _add(engine, tokenizer, "left", _grammar(HOSTILE_GRAMMAR))
        engine.step()
        time.sleep(0.5)
        engine.abort_requests(["left"])
        deadline = time.monotonic() + 2.0
        while all(is_alive(pid) for pid in helpers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(not is_alive(pid) for pid in helpers)  # killed within 2 s of the abort
        assert not engine.has_work()
        done = _run_until_done(engine, tokenizer, {"next": _choice(["yes", "no"])})
        assert done["next"][1].finish_reason == "stop" and done["next"][0] < TRIVIAL_WITHIN_S
        assert ("grammar", HOSTILE_GRAMMAR, False) not in engine.structured.grammars
    finally:
        engine.shutdown()


def test_a_grammar_past_the_memory_limit_is_refused(tiny_llama, tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", "16")
    engine = _engine(tiny_llama, 300.0)
    try:
        big = [f"choice number {i}" for i in range(10_000)]  # about 44 MiB compiled
        compiles = []
        done = _run_until_done(engine, tokenizer, {"big": _choice(big)}, within_s=400,
                               compiles=compiles)
        output = done["big"][1]
        assert output.error_kind == "invalid_request" and "VLLM_XGRAMMAR_CACHE_MB" in \
            output.error and "16 MiB" in output.error
        assert [s.outcome for s in compiles] == ["memory"]
    finally:
        engine.shutdown()


def test_a_slow_compile_is_logged_with_its_request_and_time(core, tokenizer, monkeypatch,
                                                            caplog):
    from gateway.engine.structured_output import manager

    monkeypatch.setattr(manager, "SLOW_GRAMMAR_COMPILE_S", 0.0)
    with caplog.at_level(logging.WARNING):
        _run_until_done(core, tokenizer, {"slowish": _choice(["slow", "fast", "logged"])})
    lines = [r.getMessage() for r in caplog.records if "Slow grammar" in r.getMessage()]
    assert len(lines) == 1 and "request slowish (structured_outputs.choice)" in lines[0]
    assert " s to compile" in lines[0]


def test_the_grammar_cache_is_bounded_in_bytes():
    cache = GrammarCache(budget_bytes=100)
    for i in range(5):
        cache.put(("json", str(i), False), f"grammar {i}", 30)
    assert cache.num_bytes == 90 and len(cache) == 3  # the two oldest went
    assert cache.get(("json", "0", False)) is None and cache.get(("json", "4", False))
    cache.get(("json", "2", False))  # used: now the most recent
    cache.put(("json", "5", False), "grammar 5", 30)
    assert ("json", "2", False) in cache and ("json", "3", False) not in cache
    cache.put(("json", "huge", False), "huge", 101)  # larger than the whole cache
    assert ("json", "huge", False) not in cache and cache.num_bytes == 90


def test_the_cache_size_comes_from_vllms_variable(monkeypatch):
    from gateway import envs

    monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", "64")
    assert envs.xgrammar_cache_mb() == 64
    monkeypatch.delenv("VLLM_XGRAMMAR_CACHE_MB")
    assert envs.xgrammar_cache_mb() == 512
    monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="VLLM_XGRAMMAR_CACHE_MB"):
        envs.xgrammar_cache_mb()


def test_a_json_schema_trial_matches_the_engines_own_compile(core, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=(
        StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)))
    done = _run_until_done(core, tokenizer, {"schema": params})
    assert done["schema"][1].finish_reason in ("stop", "length")
