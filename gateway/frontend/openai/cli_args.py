"""The `gateway serve` flags of the OpenAI surface (vLLM's names): choices per request,
the model's sampling defaults, the chat template, and CORS."""

from __future__ import annotations

import argparse
import json

from gateway.frontend.cli.arg_types import int_at_least
from gateway.frontend.openai.sampling import DEFAULT_MAX_N


def add_openai_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("OpenAI API")
    group.add_argument("--max-n", type=int_at_least(1), default=DEFAULT_MAX_N,
                       help=f"the most choices (n) one request may ask for per prompt "
                       f"(default {DEFAULT_MAX_N})")
    group.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                       help="default sampling parameters: auto (the model's "
                       "generation_config.json or GGUF sampling metadata), vllm (the API's "
                       "own defaults), or a folder holding a generation_config.json")
    group.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) used "
                       "instead of the model's")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a request bring its own chat_template (refused otherwise)")
    cors = parser.add_argument_group("CORS")
    cors.add_argument("--allowed-origins", type=_json_list, default=["*"],
                      help='origins a browser may call from, as JSON (default ["*"])')
    cors.add_argument("--allowed-methods", type=_json_list, default=["*"],
                      help='HTTP methods allowed cross-origin, as JSON (default ["*"])')
    cors.add_argument("--allowed-headers", type=_json_list, default=["*"],
                      help='request headers allowed cross-origin, as JSON (default ["*"])')
    cors.add_argument("--allow-credentials", action="store_true",
                      help="allow cross-origin requests with credentials (cookies, auth)")


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}"
                                         ) from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value
