"""What a request constrains its output to (vLLM's `StructuredOutputsParams`): shared
vocabulary, carried inside `SamplingParams` from the front end to the engine core, where
the grammar is compiled (gateway/engine/structured_output/).

Plain data only (a msgspec Struct): a JSON schema travels as JSON text, so its property
order (which is the order the output writes them in) survives msgpack.
"""

from __future__ import annotations

import msgspec

#: A grammar compilation longer than this is slow: the engine core logs it, and the
#: front end counts it (gateway_grammar_slow_compiles_total).
SLOW_GRAMMAR_COMPILE_S = 1.0
#: The constraint kinds, in the order vLLM documents them.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` is set."""

    json: str | None = None  # a JSON schema, as JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style, as xgrammar and llama.cpp read it)
    json_object: bool | None = None  # any JSON object
    #: No whitespace between JSON tokens beyond a single space (vLLM's flag).
    disable_any_whitespace: bool = False
    #: The request field the constraint came from ("response_format", "guided_json",
    #: "tool_choice", ...): a compile error names it in its 400.
    source_param: str = "structured_outputs"

    def kind_and_spec(self) -> tuple[str, str]:
        """(kind, spec text) of the one constraint set; ValueError if not exactly one."""
        kinds = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("exactly one of json, regex, choice, grammar and json_object "
                             f"must be set, got {', '.join(kinds) or 'none'}")
        kind = kinds[0]
        value = getattr(self, kind)
        if kind == "choice":
            return kind, msgspec.json.encode(value).decode()
        return kind, "" if kind == "json_object" else str(value)

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """Requests with equal keys share one compiled grammar."""
        kind, spec = self.kind_and_spec()
        return kind, spec, self.disable_any_whitespace
