"""A request's own `chat_template` (only with --trust-request-chat-template), rendered in
helper processes (API-server process).

Jinja's sandbox keeps a template from reaching anything outside it, but not from working
forever: nested loops run for minutes, a string doubled in a loop fills the memory, and a
thread that renders cannot be stopped. So a request's template renders in one of
`NUM_HELPERS` helper processes (gateway.helper_process), each with a memory limit, and one
that renders longer than --chat-template-render-timeout is killed (a 400 naming the
limit). The waits run in threads of their own, one per helper, so a slow template holds
neither the event loop nor the tokenizer's threads (prompt_work.py).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.frontend.http.errors import OpenAIError
from gateway.helper_process import HelperJobError, HelperLimitError, HelperPool

NUM_HELPERS = 2
MEMORY_BYTES = 512 * 1024 * 1024  # each helper's, above its size after start-up
DEFAULT_RENDER_TIMEOUT_S = 5.0
PARAM = "chat_template"
_T = TypeVar("_T")
_helpers: HelperPool | None = None  # made at first use, in the serving process
_executor: ThreadPoolExecutor | None = None


def render_request_template(source: str, variables: Mapping[str, Any], max_chars: int,
                            timeout_s: float | None) -> str:
    """The rendered text (blocking, at most `timeout_s` once a helper is free); a 400
    naming the limit the template passed, or what it raised."""
    global _helpers
    if _helpers is None:
        _helpers = HelperPool("gateway.template_sandbox", size=NUM_HELPERS,
                              memory_bytes=MEMORY_BYTES, name="chat-template",
                              preload=["gateway.template_sandbox"])
    try:
        text: str = _helpers.run([source, dict(variables), max_chars], timeout_s)
    except HelperLimitError as exc:
        raise OpenAIError(400, _limit_message(exc, timeout_s), param=PARAM,
                          code="template_limit") from None
    except HelperJobError as exc:
        if exc.kind == "TemplateOutputError":
            raise OpenAIError(400, f"The request's chat_template writes more than {max_chars} "
                              "characters, more than the context can hold.", param=PARAM,
                              code="template_limit") from None
        raise OpenAIError(400, "The chat template (the request's chat_template) could not "
                          f"render these messages: {exc.kind}: {exc}", param=PARAM) from None
    except (RuntimeError, OSError) as exc:  # no helper could start
        raise OpenAIError(503, f"The chat template cannot be rendered now: {exc}",
                          code="template_unavailable") from None
    return text


def _limit_message(exc: HelperLimitError, timeout_s: float | None) -> str:
    if exc.limit == "time":
        return (f"The request's chat_template took longer than {timeout_s:g} s to render, "
                "this server's limit (--chat-template-render-timeout).")
    return (f"The request's chat_template needed more than {MEMORY_BYTES >> 20} MiB to "
            "render, this server's limit.")


async def off_loop_for_request_template(function: Callable[..., _T], *args: Any,
                                        **kwargs: Any) -> _T:
    """`function(*args, **kwargs)` in the threads that wait for the template helpers."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(NUM_HELPERS, thread_name_prefix="gateway-template")
    return await asyncio.get_running_loop().run_in_executor(
        _executor, functools.partial(function, *args, **kwargs))
