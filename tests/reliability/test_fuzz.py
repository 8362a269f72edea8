"""End to end: schemathesis fuzzes one real `gateway serve` from the server's own
/openapi.json.

The tiny model, with the example endpoint plugins (summarize, server_info) pip-installed and
allowlisted, so the schema holds every core operation and the plugin routes (`OPERATIONS`;
a test checks that list against the schema, so a new route is fuzzed too). Each operation
gets `MAX_EXAMPLES` cases of data that fits its schema and as many that does not, and every
response must: not be a 5xx, have a status code and content type the schema documents,
match the documented body schema, and refuse (4xx) data that breaks the request schema.
A short context (`--max-model-len 128`) bounds each generation.

schemathesis drives hypothesis here directly (`APIOperation.as_strategy`), one test per
operation: its own pytest integration (`from_fixture`) does not run under pytest 9.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis import checks as generic_checks
from schemathesis.specs.openapi import checks as openapi_checks

from tests.entrypoints.conftest import EXAMPLE_PLUGINS, tiny_server

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
        ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
        ("POST", "/detokenize")]
PLUGINS = [("POST", "/v1/summarize"), ("GET", "/v1/server-info")]
OPERATIONS = CORE + PLUGINS
#: The operations that take a body: only they can be sent data that breaks their schema.
WITH_BODY = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/summarize")]
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
