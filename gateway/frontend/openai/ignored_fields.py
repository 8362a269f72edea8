"""Request fields neither OpenAI nor vLLM defines: never dropped unseen (API-server process).

Each such top-level field is logged at WARNING the first time its name is seen (vLLM
logs them too), and the response names the fields it ignored in `X-Ignored-Fields`, so
the client sees that the server did not act on them. Names are percent-encoded in the
header and shown with repr() in the log, so a hostile name cannot forge a header or a
log line; only the first names are remembered, so such names cannot grow the memory.
"""

from __future__ import annotations

from urllib.parse import quote

from pydantic import BaseModel
from starlette.responses import Response

from gateway.logger import init_logger

logger = init_logger(__name__)

HEADER = "X-Ignored-Fields"
#: Fields of structured outputs, tools and reasoning: another module owns them, so they
#: are never reported here as unknown.
DELEGATED_FIELDS = frozenset({
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "guided_json_object", "tools", "tool_choice", "parallel_tool_calls", "reasoning",
    "reasoning_effort", "include_reasoning"})
_MAX_REMEMBERED = 1024
_MAX_HEADER_CHARS = 1024
_warned: set[str] = set()  # names already logged, this process


def ignored_fields(body: BaseModel) -> list[str]:
    """The request's top-level fields that nothing defines, in the order sent."""
    return [name for name in (body.model_extra or {}) if name not in DELEGATED_FIELDS]


def report_ignored(body: BaseModel, response: Response, route: str) -> Response:
    """Log the new names once and set the header on `response` (returned)."""
    names = ignored_fields(body)
    if not names:
        return response
    for name in names:
        if name not in _warned and len(_warned) < _MAX_REMEMBERED:
            _warned.add(name)
            logger.warning("%s: the request field %r is not an OpenAI or vLLM field; it is "
                           "ignored (named in the %s response header).", route, name[:100],
                           HEADER)
    value = ",".join(quote(name, safe="_-.") for name in names)
    response.headers[HEADER] = value[:_MAX_HEADER_CHARS]
    return response
