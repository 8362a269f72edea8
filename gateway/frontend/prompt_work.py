"""Turning request text into token ids without stalling the event loop (front end).

1. A cheap length check first: text longer than `MAX_CHARS_PER_TOKEN` characters per token
   of the context cannot fit whatever it tokenizes to, so it is refused with a 400 at once,
   before any work (a huge prompt would otherwise freeze every stream while tokenized).
2. Then the chat template and the tokenizer run in a small thread pool, not on the event
   loop; a long text is tokenized by a call that releases the GIL (gateway/tokenizer.py).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.frontend.http.errors import OpenAIError

MAX_CHARS_PER_TOKEN = 16  # far above any tokenizer's average (about 4 for English)
NUM_THREADS = 2
_T = TypeVar("_T")
_executor: ThreadPoolExecutor | None = None  # made at first use, in the serving process


def check_text_length(value: Any, max_model_len: int, param: str) -> None:
    """400 naming `param` when the text in `value` (a string, or lists and dicts of them,
    e.g. chat messages) is longer than the context could ever hold."""
    num_chars, limit = text_length(value), MAX_CHARS_PER_TOKEN * max_model_len
    if num_chars > limit:
        raise OpenAIError(400, f"The {param} holds {num_chars} characters, more than the "
                          f"{max_model_len}-token context can hold (at most {limit}).",
                          param=param)


def text_length(value: Any) -> int:
    """Characters in every string inside `value` (iterative: any depth)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif hasattr(item, "__pydantic_fields__"):  # a request model (a chat message)
            stack.extend(vars(item).values())
            stack.extend((getattr(item, "__pydantic_extra__", None) or {}).values())
    return total


async def off_loop(function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """`function(*args, **kwargs)` in the tokenizer threads."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="gateway-tokenize")
    return await asyncio.get_running_loop().run_in_executor(
        _executor, functools.partial(function, *args, **kwargs))
