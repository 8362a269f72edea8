"""End to end: schemathesis fuzzes one real `gateway serve` from the server's own
/openapi.json.

The tiny model, with the example endpoint plugins (summarize, server_info) pip-installed and
allowlisted, so the schema holds every core operation and the plugin routes (`OPERATIONS`;
a test checks that list against the schema, so a new route is fuzzed too). Each operation
gets `MAX_EXAMPLES` cases of data that fits its schema and as many that does not, and every
response must: not be a 5xx, have a status code and content type the schema documents,
match the documented body schema, and refuse (4xx) data that breaks the request schema.
A short context (`--max-model-len 128`) bounds each generation.

schemathesis never generates a lone UTF-16 surrogate (it cannot encode one as UTF-8), the
input that most often gave 500s here. So the bodies it generates are fuzzed once more with
surrogates spliced into their strings and keys (`with_surrogates`): sent as JSON escapes
(`"\\ud800"`), a lone one must get a 400 naming a field that holds one; a pair (an
escaped emoji) or a backslash typed before `ud800` is text, and gets no 5xx.

schemathesis drives hypothesis here directly (`APIOperation.as_strategy`), one test per
operation: its own pytest integration (`from_fixture`) does not run under pytest 9.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis import checks as generic_checks
from schemathesis.specs.openapi import checks as openapi_checks

from tests.frontend.conftest import EXAMPLE_PLUGINS, tiny_server

pytestmark = pytest.mark.e2e

#: Cases per operation and per mode (fitting data, breaking data); more for a deeper run:
#: GATEWAY_FUZZ_EXAMPLES=500 scripts/test tests/reliability/test_fuzz.py
MAX_EXAMPLES = int(os.environ.get("GATEWAY_FUZZ_EXAMPLES", "25"))
CHECKS = [
    generic_checks.not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
    openapi_checks.negative_data_rejection,
]
CORE = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/load"),
        ("GET", "/version"),
        ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/v1/plugins"),
        ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"), ("POST", "/tokenize"),
        ("POST", "/detokenize")]
PLUGINS = [("POST", "/v1/summarize"), ("GET", "/v1/server-info")]
OPERATIONS = CORE + PLUGINS
#: The operations that take a body: only they can be sent data that breaks their schema.
WITH_BODY = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("POST", "/v1/responses"), ("POST", "/tokenize"), ("POST", "/detokenize"),
             ("POST", "/v1/summarize")]
CASES = [(*op, GenerationMode.POSITIVE) for op in OPERATIONS] + \
    [(*op, GenerationMode.NEGATIVE) for op in WITH_BODY]


@pytest.fixture(scope="module")
def server(tiny_model, example_plugins_site, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "fuzz-server.log"
    with tiny_server(tiny_model, "--max-model-len", "128", roots=(example_plugins_site,),
                     log_path=log, VLLM_PLUGINS=",".join(EXAMPLE_PLUGINS)) as server:
        yield server
    assert server.process.returncode == 0, server.log_tail()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url("/openapi.json"))


def test_schema_lists_every_core_and_plugin_operation(api_schema):
    found = {(op.method.upper(), op.path) for op in
             (result.ok() for result in api_schema.get_all_operations())}
    assert found == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_operation_survives_fuzzing(api_schema, server, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        case.call_and_validate(checks=CHECKS, timeout=60)

    fuzz()
    assert server.process.poll() is None, server.log_tail()


# ------------------------------------------------------------------ lone surrogates
#: What gets spliced into a string: lone surrogates, and the look-alikes that are text (a
#: pair, which two adjacent lone ones can also make, and a typed backslash before "ud800").
PIECES = st.one_of(
    st.sampled_from(["\ud800", "\udfff", "\ud83d\ude00", "\\", "\\ud800", "\\udc00", "x"]),
    st.characters(categories=["Cs"]))
SPLICE = st.lists(PIECES, min_size=1, max_size=4).map("".join)


@st.composite
def with_surrogates(draw: st.DrawFn, value: Any) -> Any:
    """`value` (a JSON body) with SPLICE text inserted into some of its strings and keys,
    and into at least one place (a new member or item where it holds no string)."""
    spliced = [False]

    def splice(text: str) -> str:
        if not draw(st.booleans()):
            return text
        spliced[0] = True
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(SPLICE) + text[at:]

    def rebuild(item: Any) -> Any:
        if isinstance(item, str):
            return splice(item)
        if isinstance(item, dict):
            return {splice(key): rebuild(child) for key, child in item.items()}
        if isinstance(item, list):
            return [rebuild(child) for child in item]
        return item

    result = rebuild(value)
    if not spliced[0]:
        if isinstance(result, dict):
            result[draw(SPLICE)] = draw(SPLICE)
        elif isinstance(result, list):
            result.append(draw(SPLICE))
        else:
            result = draw(SPLICE)
    return result


def not_text_fields(value: Any, path: str = "") -> set[str]:
    """Where a parsed JSON value holds a string that is not Unicode (the path as the server
    names it: `messages[0].content`; a key names its object, or `body`)."""
    if isinstance(value, str):
        return set() if _is_text(value) else {path or "body"}
    found: set[str] = set()
    if isinstance(value, dict):
        for key, child in value.items():
            if not _is_text(key):
                found.add(path or "body")
            found |= not_text_fields(child, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, child in enumerate(value):
            found |= not_text_fields(child, f"{path}[{i}]")
    return found


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@pytest.mark.parametrize(("method", "path", "mode"),
                         [(*op, mode) for op in WITH_BODY for mode in GenerationMode])
def test_lone_surrogates_in_fuzzed_bodies_get_a_400_naming_the_field(
        api_schema, server, http, method, path, mode):
    operation = api_schema[path][method]
    bodies = operation.as_strategy(generation_mode=mode).flatmap(
        lambda case: with_surrogates(case.body))

    @given(body=bodies)
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(body):
        # Sent here, not by schemathesis: it validates what it sends, and its validator
        # cannot read a lone surrogate. json.dumps escapes one as \udXXX (ASCII output).
        sent = json.dumps(body)
        response = http.request(method, path, content=sent,
                                headers={"Content-Type": "application/json"})
        assert response.status_code < 500, (sent, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, (sent, error)
        not_text = not_text_fields(json.loads(sent))
        if not_text:
            assert response.status_code == 400, (sent, response.text)
            assert (error["code"], error["param"]) in \
                {("invalid_unicode", field) for field in not_text}, (sent, error, not_text)

    fuzz()
    assert server.process.poll() is None, server.log_tail()
