"""Caps on the size of a structured-output constraint (API-server process).

Grammar compilation costs grow fast with a constraint's size (docs/structured-outputs.md
has the figures). So a constraint is measured here, before anything is sent to the engine
core, and one past a cap is a 400 naming the field and the cap (the flags of `gateway
serve` raise them): its text (the schema as JSON, the regex, the grammar, the choices) in
bytes; the values of a schema's enums, all together, or the items of a choice list; how
deeply a schema's objects and arrays nest. The engine core bounds the compilation of what
passes (a time limit, a memory limit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn

from gateway.frontend.http.errors import OpenAIError
from gateway.structured_outputs_params import StructuredOutputsParams

DEFAULT_MAX_BYTES = 256 * 1024
DEFAULT_MAX_ENUM_VALUES = 10_000
DEFAULT_MAX_DEPTH = 64


@dataclass(frozen=True)
class SpecLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_enum_values: int = DEFAULT_MAX_ENUM_VALUES
    max_depth: int = DEFAULT_MAX_DEPTH


def parse_schema_text(text: str, param: str, limits: SpecLimits) -> Any:
    """A JSON schema given as JSON text, parsed; a 400 naming `param` when it is too
    large, not JSON, or nested too deeply for the parser."""
    check_size(len(text.encode()), param, limits)
    try:
        return json.loads(text)
    except RecursionError:
        _refuse(param, f"the JSON schema nests deeper than {limits.max_depth} levels, this "
                "server's limit (--structured-outputs-max-depth)")
    except ValueError as exc:
        _refuse(param, f"the JSON schema is not valid JSON: {exc}")


def check_schema(schema: Any, param: str, limits: SpecLimits) -> None:
    """Depth and enum values of a parsed schema (iterative: any depth)."""
    num_values, stack = 0, [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limits.max_depth:
            _refuse(param, f"the JSON schema nests deeper than {limits.max_depth} levels, "
                    "this server's limit (--structured-outputs-max-depth)")
        if isinstance(value, dict):
            enum = value.get("enum")
            if isinstance(enum, list):
                num_values += len(enum)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    check_values(num_values, param, limits, "enum values")


def check_spec(params: StructuredOutputsParams, limits: SpecLimits) -> None:
    """Every cap, on a constraint as it would be sent to the engine core."""
    kind, spec = params.kind_and_spec()
    param = params.source_param
    check_size(len(spec.encode()), param, limits)
    if kind == "choice":
        check_values(len(params.choice or ()), param, limits, "choices")
    elif kind == "json":
        check_schema(parse_schema_text(spec, param, limits), param, limits)


def check_size(num_bytes: int, param: str, limits: SpecLimits) -> None:
    if num_bytes > limits.max_bytes:
        _refuse(param, f"the constraint is {num_bytes} bytes long; this server allows at most "
                f"{limits.max_bytes} (--structured-outputs-max-bytes)")


def check_values(num_values: int, param: str, limits: SpecLimits, what: str) -> None:
    if num_values > limits.max_enum_values:
        _refuse(param, f"the constraint has {num_values} {what}; this server allows at most "
                f"{limits.max_enum_values} (--structured-outputs-max-enum-values)")


def _refuse(param: str, message: str) -> NoReturn:
    raise OpenAIError(400, message, param=param)
