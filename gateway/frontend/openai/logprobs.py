"""Log-probabilities in OpenAI's shapes (front end), from the engine's `TokenLogprobs`.

Completions: `{tokens, token_logprobs, top_logprobs, text_offset}` (legacy shape; the
first prompt token of an echo has `null`s). Chat: `{content: [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}]}`. Tokens are shown as each decodes alone, as
vLLM does; a logprob of -inf is written -9999.0, as OpenAI and vLLM do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.messages import TokenLogprobs

_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


class TokenText:
    """Each token id's text alone, cached for the lifetime of one response."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_token_ids = as_token_ids  # vLLM's return_tokens_as_token_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None and self._as_token_ids:
            text = self._cache[token_id] = f"token_id:{token_id}"
        if text is None:
            text = str(self._tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = text
        return text


def completion_logprobs(text_of: TokenText, token_ids: Sequence[int],
                        entries: Sequence[TokenLogprobs | None], num_top: int,
                        text_offset: int = 0) -> dict[str, list[Any]]:
    """The completions `logprobs` object for these tokens (an entry None: no logprob, the
    first prompt token). `text_offset`: where the first token's text starts."""
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        token = text_of(token_id)
        result["tokens"].append(token)
        result["text_offset"].append(text_offset)
        text_offset += len(token)
        if entry is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            continue
        result["token_logprobs"].append(_value(entry.logprobs[0]))
        top = {text_of(t): _value(v) for t, v in zip(entry.token_ids[1:1 + num_top],
                                                     entry.logprobs[1:1 + num_top])}
        # vLLM's dict also holds the chosen token, when it is not among the top N.
        top.setdefault(token, _value(entry.logprobs[0]))
        result["top_logprobs"].append(top if num_top else None)
    return result


def merge_completion_logprobs(first: dict[str, list[Any]], second: dict[str, list[Any]]
                              ) -> dict[str, list[Any]]:
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(text_of: TokenText, token_ids: Sequence[int],
                  entries: Sequence[TokenLogprobs], num_top: int) -> dict[str, Any]:
    """The chat `logprobs` object: `{"content": [...]}`, one item per token."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        token = text_of(token_id)
        top = [_chat_token(text_of(t), v) for t, v in zip(entry.token_ids[1:1 + num_top],
                                                          entry.logprobs[1:1 + num_top])]
        content.append({**_chat_token(token, entry.logprobs[0]), "top_logprobs": top})
    return {"content": content}


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _value(logprob),
            "bytes": list(token.encode("utf-8", errors="replace"))}


def prompt_logprobs_json(text_of: TokenText, prompt_token_ids: Sequence[int],
                         entries: Sequence[TokenLogprobs | None]) -> list[Any]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the prompt's token and the top N."""
    result: list[Any] = []
    for token_id, entry in zip(prompt_token_ids, entries):
        if entry is None:
            result.append(None)
            continue
        item = {str(token_id): {"logprob": _value(entry.logprobs[0]), "rank": entry.rank,
                                "decoded_token": text_of(token_id)}}
        for rank, (t, v) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:]), start=1):
            item.setdefault(str(t), {"logprob": _value(v), "rank": rank,
                                     "decoded_token": text_of(t)})
        result.append(item)
    return result
