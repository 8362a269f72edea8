"""The Jinja sandbox chat templates render in (any process that renders a chat template: the
API server, its template helper processes, a tokenizer elsewhere).

The environment is transformers' (an ImmutableSandboxedEnvironment with `tojson`,
`raise_exception` and `strftime_now`), so templates render alike, with two bounds on one
render's work: `render_template` stops as soon as the output passes `max_chars`
(TemplateOutputError), and a repetition (`'x' * 1000000000`, a list times a number) or a
power whose result would pass `max_chars` is refused before it is made. Loops can still
run long (Jinja caps `range` at 100,000, but loops nest), so a request's own template
renders in a helper process with a time limit (frontend/openai/request_templates.py).
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: Output characters when the caller gives no limit.
DEFAULT_MAX_CHARS = 1 << 22
#: Bits of the largest integer a power may make (a 10**10**10 would take minutes).
MAX_POWER_BITS = 1 << 16

_max_chars: ContextVar[int] = ContextVar("max_chars", default=DEFAULT_MAX_CHARS)


class TemplateError(ValueError):
    """A chat template raised (`raise_exception`) or could not be rendered."""


class TemplateOutputError(TemplateError):
    """A template that wrote (or tried to make a string) longer than the limit."""

    def __init__(self, max_chars: int) -> None:
        super().__init__(f"the template's text would pass {max_chars} characters")
        self.max_chars = max_chars


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator_name: str, left: Any,
                   right: Any) -> Any:
        if operator_name == "**":
            _check_power(left, right)
            return operator.pow(left, right)
        _check_repeat(left, right)
        return operator.mul(left, right)


def _check_repeat(left: Any, right: Any) -> None:
    for sequence, times in ((left, right), (right, left)):
        if isinstance(sequence, (str, list, tuple)) and isinstance(times, int) \
                and len(sequence) * times > _max_chars.get():
            raise TemplateOutputError(_max_chars.get())


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 \
            and exponent > 0 and abs(base).bit_length() * exponent > MAX_POWER_BITS:
        raise TemplateError(f"{base} ** {exponent} is too large to compute")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    # The same environment transformers uses, so templates render alike.
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_template(source: str, variables: Mapping[str, Any],
                    max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """`source` rendered with `variables`; TemplateOutputError as soon as the text passes
    `max_chars`."""
    token = _max_chars.set(max_chars)
    try:
        pieces, num_chars = [], 0
        for piece in compile_template(source).generate(**variables):
            num_chars += len(piece)
            if num_chars > max_chars:
                raise TemplateOutputError(max_chars)
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _max_chars.reset(token)


def start_helper(arg: Any) -> Callable[[list[Any]], str]:
    """The job function of a chat-template helper process (gateway.helper_process):
    [source, variables, max_chars] -> the rendered text."""
    def render(job: list[Any]) -> str:
        source, variables, max_chars = job
        return render_template(source, variables, max_chars)

    return render
