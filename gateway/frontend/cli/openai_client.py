"""A small OpenAI-API client for `gateway chat` and `gateway complete` (vLLM's `vllm chat` /
`vllm complete`; it runs in that command's own process): the standard library's HTTP, streamed
answers read as server-sent events. It talks to any OpenAI-compatible server, not only this one."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

DEFAULT_URL = "http://localhost:8000/v1"


class ClientError(Exception):
    """The server could not be reached, or answered with an error (the message says
    which)."""


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"the server's OpenAI API base URL (default {DEFAULT_URL})")
    parser.add_argument("--model-name", default=None,
                        help="the model to ask (default: the first one /v1/models lists)")
    parser.add_argument("--api-key", default=None,
                        help="the API key (default: $OPENAI_API_KEY, then none)")


class OpenAIClient:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout_s = timeout_s

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OpenAIClient:
        return cls(args.url, args.api_key)

    def model_name(self, chosen: str | None) -> str:
        """`chosen`, or the first model the server lists."""
        if chosen:
            return chosen
        models = json.load(self._open("GET", "/models")).get("data") or []
        if not models:
            raise ClientError(f"{self.url}/models lists no model")
        return str(models[0]["id"])

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed answer, until `data: [DONE]`."""
        with self._open("POST", path, {**body, "stream": True}) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ClientError(_error_text(chunk))
                yield chunk

    def _open(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers=headers,
                                         method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)  # noqa: S310
        except urllib.error.HTTPError as exc:
            try:
                text = _error_text(json.loads(exc.read()))
            except ValueError:
                text = exc.reason
            raise ClientError(f"{method} {self.url + path}: HTTP {exc.code}: {text}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ClientError(f"cannot reach {self.url}: {reason}") from None


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message"))
    return str(payload)
