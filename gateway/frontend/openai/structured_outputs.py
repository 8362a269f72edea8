"""From a request's constraint fields to `StructuredOutputsParams` (front end).

Sources, each a 400 naming it when malformed: `response_format` (json_object, json_schema),
vLLM's `structured_outputs` object, and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`. At most one may be given, within the size caps of
structured_output_limits.py. The grammar itself is compiled in the engine core, which
answers a spec it cannot compile (in time) with a 400 naming the field before the request
is scheduled (the front end does not load the grammar engine).
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.protocol import SamplingFields, StructuredOutputsRequest
from gateway.frontend.openai.structured_output_limits import (
    SpecLimits,
    check_schema,
    check_size,
    check_spec,
    parse_schema_text,
)
from gateway.structured_outputs_params import StructuredOutputsParams

_BACKENDS = (None, "auto", "xgrammar")


def structured_outputs_of(request: SamplingFields, limits: SpecLimits | None = None
                          ) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, or None (400s naming the field)."""
    limits = limits or SpecLimits()
    _check_guided_options(request)
    found = [params for params in (_from_response_format(request, limits),
                                   _from_structured_outputs(request.structured_outputs,
                                                            limits),
                                   *_from_guided(request, limits)) if params is not None]
    if len(found) > 1:
        names = ", ".join(p.source_param for p in found)
        _refuse(found[1].source_param, f"only one output constraint may be given, got {names}")
    if found and found[0].json is None:  # a schema was measured as it was read
        check_spec(found[0], limits)
    return found[0] if found else None


def json_schema_params(schema: Any, param: str, limits: SpecLimits | None = None
                       ) -> StructuredOutputsParams:
    """A JSON-schema constraint; a schema that is not JSON, an object or a boolean, or
    one past a size cap, is a 400."""
    limits = limits or SpecLimits()
    if isinstance(schema, str):
        schema = parse_schema_text(schema, param, limits)
    if not isinstance(schema, (dict, bool)):
        _refuse(param, "a JSON schema must be an object (or a boolean)")
    check_schema(schema, param, limits)
    text = json.dumps(schema, ensure_ascii=False)
    check_size(len(text.encode()), param, limits)
    return StructuredOutputsParams(json=text, source_param=param)


def _from_response_format(request: SamplingFields, limits: SpecLimits
                          ) -> StructuredOutputsParams | None:
    response_format = getattr(request, "response_format", None)
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, source_param="response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            _refuse("response_format", "response_format of type 'json_schema' needs "
                    "json_schema.schema")
        return json_schema_params(spec["schema"], "response_format", limits)
    _refuse("response_format", f"response_format type {kind!r} is not supported; use "
            "'text', 'json_object' or 'json_schema'")


def _from_structured_outputs(fields: StructuredOutputsRequest | None, limits: SpecLimits
                             ) -> StructuredOutputsParams | None:
    if fields is None:
        return None
    param = "structured_outputs"
    values = {"json": fields.json_schema, "regex": fields.regex, "choice": fields.choice,
              "grammar": fields.grammar, "json_object": fields.json_object}
    given = [name for name, value in values.items() if value not in (None, False)]
    if len(given) != 1:
        _refuse(param, "structured_outputs needs exactly one of json, regex, choice, grammar "
                f"and json_object, got {', '.join(given) or 'none'}")
    kind = given[0]
    if kind == "json":
        params = json_schema_params(fields.json_schema, f"{param}.json", limits)
    elif kind == "json_object":
        params = StructuredOutputsParams(json_object=True, source_param=param)
    else:
        params = _text_constraint(kind, values[kind], f"{param}.{kind}")
    params.disable_any_whitespace = fields.disable_any_whitespace
    return params


def _from_guided(request: SamplingFields, limits: SpecLimits
                 ) -> list[StructuredOutputsParams]:
    found = []
    if request.guided_json is not None:
        found.append(json_schema_params(request.guided_json, "guided_json", limits))
    for kind in ("regex", "choice", "grammar"):
        value = getattr(request, f"guided_{kind}")
        if value is not None:
            found.append(_text_constraint(kind, value, f"guided_{kind}"))
    return found


def _text_constraint(kind: str, value: Any, param: str) -> StructuredOutputsParams:
    if kind == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            _refuse(param, "choice must be a non-empty list of non-empty strings")
        return StructuredOutputsParams(choice=list(value), source_param=param)
    if not isinstance(value, str) or not value.strip():
        _refuse(param, f"{kind} must be a non-empty string")
    if kind == "regex":
        return StructuredOutputsParams(regex=value, source_param=param)
    return StructuredOutputsParams(grammar=value, source_param=param)


def _check_guided_options(request: SamplingFields) -> None:
    if request.guided_decoding_backend not in _BACKENDS:
        _refuse("guided_decoding_backend", "this server's structured-output backend is "
                f"xgrammar; guided_decoding_backend {request.guided_decoding_backend!r} is "
                "not available")
    if request.guided_whitespace_pattern is not None:
        _refuse("guided_whitespace_pattern", "guided_whitespace_pattern is not supported; "
                "use structured_outputs.disable_any_whitespace")


def _refuse(param: str, message: str) -> NoReturn:
    raise OpenAIError(400, message, param=param)
