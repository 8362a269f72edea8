"""`gateway chat`: chat with a running server from the terminal (vLLM's `vllm chat`).
Each answer streams as it is generated; the conversation is kept until the end of input
(Ctrl-D). `--quick MESSAGE` sends one message and exits."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gateway.frontend.cli.openai_client import ClientError, OpenAIClient, add_connection_args


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("chat", help="chat with a running server (streamed)",
                            description=__doc__)
    add_connection_args(parser)
    parser.add_argument("--system-prompt", default=None,
                        help="a system message put first in the conversation")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="the most tokens per answer (default: the server's)")
    parser.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                        help="send one message, print the answer and exit")


def run(args: argparse.Namespace) -> int:
    client = OpenAIClient.from_args(args)
    try:
        model = client.model_name(args.model_name)
        conversation = Conversation(args.system_prompt)
        if args.quick is not None:
            answer(client, model, conversation, args.quick, args.max_tokens)
            return 0
        print(f"Using model: {model} (Ctrl-D to quit)", file=sys.stderr)
        while (message := _read("> ")) is not None:
            answer(client, model, conversation, message, args.max_tokens)
        return 0
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


class Conversation:
    """The messages so far, the system prompt first."""

    def __init__(self, system_prompt: str | None = None) -> None:
        self.messages: list[dict[str, str]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})

    def ask(self, text: str) -> list[dict[str, str]]:
        self.messages.append({"role": "user", "content": text})
        return self.messages

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def answer(client: OpenAIClient, model: str, conversation: Conversation, text: str,
           max_tokens: int | None = None) -> str:
    """Send `text`, print the answer as it streams, and keep it in the conversation."""
    pieces = []
    body: dict[str, Any] = {"model": model, "messages": conversation.ask(text)}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    for chunk in client.stream("/chat/completions", body):
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or ""
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    conversation.answered("".join(pieces))
    return "".join(pieces)


def _read(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None
