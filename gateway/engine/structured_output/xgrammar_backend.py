"""The grammar engine (engine-core process and its trial-compile helpers): xgrammar,
vLLM's default backend.

`XgrammarBackend` turns a constraint into a compiled grammar (slow: milliseconds to
minutes, run off the step loop by the manager, after a trial in a helper process that can
be stopped) and makes a cheap matcher per request from it. xgrammar imports torch and
transformers, so only the engine core and its helpers import this module.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import xgrammar as xgr

from gateway.tokenizer import Tokenizer

# Compilation threads inside xgrammar, per grammar: small, the step loop shares the cores.
_COMPILE_THREADS = 2


class GrammarSpecError(ValueError):
    """A schema, regex, choice or grammar that xgrammar cannot compile."""


class XgrammarBackend:
    def __init__(self, info: xgr.TokenizerInfo) -> None:
        self.info = info
        self.vocab_size = info.vocab_size
        # No xgrammar cache: the manager caches compiled grammars by key itself.
        self.compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS,
                                            cache_enabled=False)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int,
                      stop_token_ids: list[int]) -> XgrammarBackend:
        return cls(xgr.TokenizerInfo(encoded_vocab(tokenizer, vocab_size),
                                     vocab_type=_vocab_type(tokenizer), vocab_size=vocab_size,
                                     stop_token_ids=list(stop_token_ids),
                                     add_prefix_space=False))

    def compile(self, kind: str, spec: str, disable_any_whitespace: bool) -> Any:
        """A compiled grammar; GrammarSpecError with xgrammar's reason when it cannot be."""
        try:
            if kind == "json":
                grammar = xgr.Grammar.from_json_schema(
                    spec, any_whitespace=not disable_any_whitespace)
                return self.compiler.compile_grammar(_without_raw_control_chars(grammar))
            if kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "grammar":
                return self.compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            if "bad_alloc" in str(exc):  # C++ out of memory (a trial helper's cap)
                raise MemoryError(str(exc)) from None
            raise GrammarSpecError(_reason(exc)) from None
        raise GrammarSpecError(f"unknown constraint kind {kind!r}")

    @staticmethod
    def matcher(compiled: Any) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """int32 [num_rows, ceil(vocab / 32)], every token allowed."""
        return np.full((num_rows, -(-self.vocab_size // 32)), -1, dtype=np.int32)


# xgrammar writes the characters of a string with a length bound (maxLength, minLength)
# as this class, which lets raw control characters (U+0000-U+001F) into the string: not
# JSON. Its unbounded strings exclude them; the bounded ones are given the same class.
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_STRICT_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _without_raw_control_chars(grammar: Any) -> str:
    return str(grammar).replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the choices (as vLLM builds it)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Token strings by id, in the vocabulary's own spelling. Control tokens are given as
    empty strings so that a grammar never admits them as text (an end-of-turn token spelled
    '<|im_end|>' inside a JSON string); the stop tokens stay allowed where the grammar may
    end. Ids past the tokenizer's vocabulary (a padded embedding) are empty too."""
    special = set(tokenizer.all_special_ids)
    fast = tokenizer.tokenizer
    return ["" if token_id in special else (fast.id_to_token(token_id) or "")
            for token_id in range(vocab_size)]


def _vocab_type(tokenizer: Tokenizer) -> Any:
    decoder = json.loads(tokenizer.tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


# xgrammar's messages start with "[time] /path/file.cc:line: "; the client needs the rest.
_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def _reason(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    text = _SOURCE_PREFIX.sub("", text.splitlines()[0])
    return text[:500]
