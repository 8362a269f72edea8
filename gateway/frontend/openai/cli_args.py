"""The `gateway serve` flags of the OpenAI surface (vLLM's names; parsed where `gateway serve`
starts, read by the API servers): choices per request, the model's sampling defaults, the
chat template, the responses store, the bounds of structured outputs, and CORS."""

from __future__ import annotations

import argparse
import json

from gateway.config import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, StructuredOutputsConfig
from gateway.frontend.cli.arg_types import int_at_least
from gateway.frontend.openai.request_templates import DEFAULT_RENDER_TIMEOUT_S
from gateway.frontend.openai.responses_store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_ENTRIES
from gateway.frontend.openai.sampling import DEFAULT_MAX_N, SEQS_PER_REQUEST_PER_BATCH_SEQ
from gateway.frontend.openai.structured_output_limits import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_ENUM_VALUES,
)


def add_openai_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("OpenAI API")
    group.add_argument("--max-n", type=int_at_least(1), default=DEFAULT_MAX_N,
                       help=f"the most choices (n) one request may ask for per prompt "
                       f"(default {DEFAULT_MAX_N})")
    group.add_argument("--max-seqs-per-request", type=int_at_least(1), default=None,
                       metavar="N", help="the most sequences one request may ask for: its "
                       "prompts times n (default "
                       f"{SEQS_PER_REQUEST_PER_BATCH_SEQ} x --max-num-seqs)")
    group.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                       help="default sampling parameters: auto (the model's "
                       "generation_config.json or GGUF sampling metadata), vllm (the API's "
                       "own defaults), or a folder holding a generation_config.json")
    group.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) used "
                       "instead of the model's")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a request bring its own chat_template (refused otherwise)")
    group.add_argument("--chat-template-render-timeout", type=_seconds,
                       default=DEFAULT_RENDER_TIMEOUT_S, metavar="SECONDS",
                       help="a request's own chat_template that renders longer is stopped "
                       f"and refused with a 400 (default {DEFAULT_RENDER_TIMEOUT_S:g}; 0: no "
                       "limit)")
    group.add_argument("--responses-store-max-entries", type=int_at_least(1),
                       default=DEFAULT_MAX_ENTRIES, metavar="N",
                       help="the most /v1/responses answers kept in memory for "
                       "previous_response_id; the oldest goes first (default "
                       f"{DEFAULT_MAX_ENTRIES})")
    group.add_argument("--responses-store-max-age", type=_positive_seconds,
                       default=DEFAULT_MAX_AGE_S, metavar="SECONDS",
                       help="how long a kept /v1/responses answer can be continued "
                       f"(default {DEFAULT_MAX_AGE_S:g})")
    _add_structured_outputs_args(parser.add_argument_group("structured outputs"))
    cors = parser.add_argument_group("CORS")
    cors.add_argument("--allowed-origins", type=_json_list, default=["*"],
                      help='origins a browser may call from, as JSON (default ["*"])')
    cors.add_argument("--allowed-methods", type=_json_list, default=["*"],
                      help='HTTP methods allowed cross-origin, as JSON (default ["*"])')
    cors.add_argument("--allowed-headers", type=_json_list, default=["*"],
                      help='request headers allowed cross-origin, as JSON (default ["*"])')
    cors.add_argument("--allow-credentials", action="store_true",
                      help="allow cross-origin requests with credentials (cookies, auth); "
                      "needs an explicit --allowed-origins list, not \"*\"")


def _add_structured_outputs_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--structured-outputs-compile-timeout", type=_seconds,
                       default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, metavar="SECONDS",
                       help="a grammar that takes longer to compile is stopped and its "
                       "request refused with a 400 (default "
                       f"{DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S:g}; 0: no limit)")
    group.add_argument("--structured-outputs-max-bytes", type=int_at_least(1),
                       default=DEFAULT_MAX_BYTES, metavar="N",
                       help="the longest constraint (a schema as JSON, a regex, a grammar, "
                       f"the choices), in bytes (default {DEFAULT_MAX_BYTES})")
    group.add_argument("--structured-outputs-max-enum-values", type=int_at_least(1),
                       default=DEFAULT_MAX_ENUM_VALUES, metavar="N",
                       help="the most enum values in a JSON schema (all its enums together), "
                       f"or items in a choice list (default {DEFAULT_MAX_ENUM_VALUES})")
    group.add_argument("--structured-outputs-max-depth", type=int_at_least(1),
                       default=DEFAULT_MAX_DEPTH, metavar="N",
                       help="how deeply a JSON schema's objects and arrays may nest (default "
                       f"{DEFAULT_MAX_DEPTH})")


def structured_outputs_config(args: argparse.Namespace) -> StructuredOutputsConfig:
    """What the engine core reads of these flags."""
    return StructuredOutputsConfig(
        compile_timeout_s=args.structured_outputs_compile_timeout or None)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}"
                                         ) from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}"
                                         ) from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value
