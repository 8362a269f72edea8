"""`gateway complete`: text completion against a running server from the terminal (vLLM's
`vllm complete`). Each line read is a prompt whose completion streams as it is generated;
`--quick PROMPT` completes one prompt and exits."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gateway.frontend.cli.openai_client import ClientError, OpenAIClient, add_connection_args


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("complete", help="complete text with a running server (streamed)",
                            description=__doc__)
    add_connection_args(parser)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="the most tokens per completion (default: the server's)")
    parser.add_argument("-q", "--quick", default=None, metavar="PROMPT",
                        help="complete one prompt, print it and exit")


def run(args: argparse.Namespace) -> int:
    client = OpenAIClient.from_args(args)
    try:
        model = client.model_name(args.model_name)
        if args.quick is not None:
            complete(client, model, args.quick, args.max_tokens)
            return 0
        print(f"Using model: {model} (Ctrl-D to quit)", file=sys.stderr)
        while True:
            try:
                prompt = input("> ")
            except EOFError:
                return 0
            complete(client, model, prompt, args.max_tokens)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def complete(client: OpenAIClient, model: str, prompt: str, max_tokens: int | None) -> str:
    """Print the completion of `prompt` as it streams; return it."""
    body: dict[str, Any] = {"model": model, "prompt": prompt}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    pieces = []
    for chunk in client.stream("/completions", body):
        for choice in chunk.get("choices") or []:
            pieces.append(choice.get("text") or "")
            sys.stdout.write(pieces[-1])
            sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(pieces)
