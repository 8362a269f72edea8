"""Client text that cannot forge special tokens (API-server process; torch-free).

Tokenizing a rendered chat prompt as one string would turn special-token strings
(`<|im_start|>`, ...) into special tokens where a *client* typed them, letting a message,
a tool's description or a template variable forge a system turn (docs/operations.md). So:
1. `escape_special_tokens` replaces each such string in everything the client sends to the
   template (values and keys) with a placeholder no client can guess (a per-call random
   number between two private-use characters); 2. the template renders as usual;
3. `EscapedMessages.encode` tokenizes the prompt, each placeholder back as plain text.
Input holding no special-token string is tokenized exactly as before (one `encode`).
"""

from __future__ import annotations

import re
import secrets
import weakref
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Encoding
from tokenizers import Tokenizer as FastTokenizer

from gateway.tokenizer import Tokenizer

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around a placeholder


@dataclass
class _SpecialText:
    """A tokenizer's special-token strings, and a copy of it that reads them as text."""

    pattern: re.Pattern[str] | None
    text_tokenizer: FastTokenizer


_by_tokenizer: weakref.WeakKeyDictionary[Tokenizer, _SpecialText] = \
    weakref.WeakKeyDictionary()


def _special_text(tokenizer: Tokenizer) -> _SpecialText:
    found = _by_tokenizer.get(tokenizer)
    if found is None:
        fast = tokenizer.tokenizer
        strings = sorted({t.content for t in fast.get_added_tokens_decoder().values()
                          if t.special and t.content}, key=len, reverse=True)
        text_tokenizer = FastTokenizer.from_str(fast.to_str())
        text_tokenizer.encode_special_tokens = True  # special strings split like any text
        pattern = re.compile("|".join(map(re.escape, strings))) if strings else None
        found = _by_tokenizer[tokenizer] = _SpecialText(pattern, text_tokenizer)
    return found


@dataclass
class EscapedMessages:
    """Messages and template variables to render with the chat template, and how to
    tokenize what it renders."""

    tokenizer: Tokenizer
    messages: list[dict[str, Any]]
    variables: dict[str, Any] = field(default_factory=dict)
    originals: list[str] = field(default_factory=list)  # placeholder i stands for [i]
    nonce: str = ""

    def encode(self, rendered: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of the rendered prompt (see the module docstring)."""
        if not self.originals:
            return self.tokenizer.encode(rendered, add_special_tokens=add_special_tokens)
        special = _special_text(self.tokenizer)
        assert special.pattern is not None
        placeholder = re.compile(re.escape(_OPEN + self.nonce) + r"-(\d+)" + re.escape(_CLOSE))
        pieces = placeholder.split(rendered)  # text, index, text, index, ..., text
        if any(_OPEN + self.nonce in piece for piece in pieces[::2]):
            raise ValueError("the chat template altered a message's text")
        encodings: list[Encoding] = []
        text: list[str] = []
        for number, piece in enumerate(pieces):
            if number % 2:
                text.append(self.originals[int(piece)])
                continue
            position = 0
            for match in special.pattern.finditer(piece):  # the template's own tokens
                text.append(piece[position:match.start()])
                self._flush(text, encodings, special)
                encodings.append(self.tokenizer.tokenizer.encode(match.group(),
                                                                 add_special_tokens=False))
                position = match.end()
            text.append(piece[position:])
        self._flush(text, encodings, special)
        merged = Encoding.merge(encodings, growing_offsets=True)
        if add_special_tokens:
            merged = self.tokenizer.tokenizer.post_process(merged, add_special_tokens=True)
        return list(merged.ids)

    @staticmethod
    def _flush(text: list[str], encodings: list[Encoding], special: _SpecialText) -> None:
        joined = "".join(text)
        text.clear()
        if joined:
            encodings.append(special.text_tokenizer.encode(joined, add_special_tokens=False))


def escape_special_tokens(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                          variables: dict[str, Any] | None = None) -> EscapedMessages:
    """`messages` and the template `variables` with each special-token string in their
    strings (values and keys, at any depth) replaced by a placeholder (the same objects
    when none holds one)."""
    pattern = _special_text(tokenizer).pattern
    variables = dict(variables or {})
    escaped = EscapedMessages(tokenizer, messages, variables,
                              nonce=str(secrets.randbelow(10 ** 12)))
    if pattern is None or not _holds(pattern, [messages, variables]):
        return escaped

    def placeholder(match: re.Match[str]) -> str:
        escaped.originals.append(match.group())
        return f"{_OPEN}{escaped.nonce}-{len(escaped.originals) - 1}{_CLOSE}"

    def escape(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(placeholder, value)
        if isinstance(value, list | tuple):
            return [escape(v) for v in value]
        if isinstance(value, dict):
            return {escape(k): escape(v) for k, v in value.items()}
        return value

    escaped.messages = [escape(m) for m in messages]
    escaped.variables = {k: escape(v) for k, v in variables.items()}
    return escaped


def _holds(pattern: re.Pattern[str], value: Any) -> bool:
    """Whether a string anywhere in `value` (iterative: any depth) holds the pattern."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if pattern.search(item) is not None:
                return True
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return False
