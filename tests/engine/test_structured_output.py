"""Structured outputs in the engine core, driven in-process on the tiny random model: its
free output is noise, so every constrained answer below holds only because of the mask."""

from __future__ import annotations

import json
import re
import time

import pytest

from gateway.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from gateway.engine.core import EngineCore
from gateway.messages import EngineCoreRequest
from gateway.sampling_params import SamplingParams
from gateway.structured_outputs_params import StructuredOutputsParams
from gateway.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def core(tiny_llama):
    config = EngineConfig(model=ModelConfig(model=str(tiny_llama), dtype="float32"),
                          cache=CacheConfig(kv_cache_memory_gib=0.02),
                          scheduler=SchedulerConfig(max_num_seqs=16,
                                                    max_num_batched_tokens=256))
    engine = EngineCore(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


def _params(max_tokens=48, seed=None, **constraint):
    structured = StructuredOutputsParams(**constraint) if constraint else None
    return SamplingParams(temperature=1.0 if seed is not None else 0.0, seed=seed,
                          max_tokens=max_tokens, structured_outputs=structured)


def _run(core, tokenizer, requests: dict[str, SamplingParams], prompt="Hello, world!"):
    """Run requests together to their ends: {id: (text, finish_reason, error)}."""
    ids = tokenizer.encode(prompt)
    results, tokens = {}, {rid: [] for rid in requests}
    for rid, params in requests.items():
        error = core.add_request(EngineCoreRequest(rid, ids, params, time.time()))
        if error is not None:
            results[rid] = ("", error.finish_reason, error)
    started = time.monotonic()
    while core.has_work() and time.monotonic() - started < 120:
        for output in core.step().outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.finish_reason is not None:
                results[output.request_id] = (tokenizer.decode(tokens[output.request_id]),
                                              output.finish_reason, output)
    return results


@pytest.mark.parametrize("constraint,check", [
    ({"choice": ["apple", "banana split", "cherry"]},
     lambda text: text in ("apple", "banana split", "cherry")),
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
    ({"grammar": 'root ::= "yes" | "no" | "maybe " [a-c]'},
     lambda text: re.fullmatch(r"yes|no|maybe [a-c]", text)),
])
def test_a_constrained_answer_follows_its_constraint_and_stops(core, tokenizer, constraint,
                                                                check):
    ((text, finish, _),) = _run(core, tokenizer, {"r": _params(**constraint)}).values()
    assert finish == "stop"
    assert check(text), text


@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_answers_validate_even_when_sampled(core, tokenizer, seed):
    params = _params(max_tokens=60, seed=seed, json=json.dumps(SCHEMA),
                     disable_any_whitespace=True)
    ((text, finish, _),) = _run(core, tokenizer, {"r": params}).values()
    if finish == "stop":
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
        assert isinstance(value["name"], str) and len(value["name"]) <= 8
    else:  # cut by max_tokens: a prefix of a valid answer
        assert finish == "length" and text.lstrip().startswith("{")


def test_json_object_answer_parses_as_an_object(core, tokenizer):
    params = _params(max_tokens=60, json_object=True, disable_any_whitespace=True)
    ((text, finish, _),) = _run(core, tokenizer, {"r": params}).values()
    assert finish in ("stop", "length")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)


def test_constrained_and_free_requests_share_steps_and_free_ones_are_unchanged(core, tokenizer):
    alone = _run(core, tokenizer, {"free": _params(max_tokens=12)})["free"][0]
    requests = {"free": _params(max_tokens=12)}
    requests |= {f"choice-{i}": _params(choice=[f"option {i}", f"other {i}"]) for i in range(6)}
    requests |= {f"regex-{i}": _params(regex=f"id-{i}[0-9]{{2}}") for i in range(6)}
    results = _run(core, tokenizer, requests)
    assert results["free"][0] == alone
    for i in range(6):
        assert results[f"choice-{i}"][0] in (f"option {i}", f"other {i}")
        assert re.fullmatch(f"id-{i}[0-9]{{2}}", results[f"regex-{i}"][0])


@pytest.mark.parametrize("constraint,source", [
    ({"regex": "[unclosed", "source_param": "guided_regex"}, "guided_regex"),
    ({"grammar": "root ::= undefined_rule", "source_param": "structured_outputs.grammar"},
     "structured_outputs.grammar"),
    ({"json": '{"type": "no-such-type"}', "source_param": "response_format"}, "response_format"),
])
def test_a_spec_that_does_not_compile_is_an_invalid_request_naming_its_field(
        core, tokenizer, constraint, source):
    ((_, finish, output),) = _run(core, tokenizer, {"bad": _params(**constraint)}).values()
    assert finish == "error"
    assert output.error_kind == "invalid_request" and output.error_param == source
    assert source in output.error
    assert not core.has_work()


def test_a_second_request_with_the_same_schema_reuses_the_compiled_grammar(core, tokenizer):
    params = _params(max_tokens=4, json=json.dumps({"type": "object", "properties": {
        "unique_key_for_cache_test": {"type": "string"}}}))
    _run(core, tokenizer, {"first": params})
    futures_before = dict(core.structured.grammars._entries)
    _run(core, tokenizer, {"second": params})
    assert dict(core.structured.grammars._entries) == futures_before


def test_ignore_eos_request_still_stops_at_the_end_of_its_grammar(core, tokenizer):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["done"]))
    ((text, finish, _),) = _run(core, tokenizer, {"r": params}).values()
    assert (text, finish) == ("done", "stop")
