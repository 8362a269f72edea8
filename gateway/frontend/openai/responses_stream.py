"""`/v1/responses` with `stream: true` (front end): the Responses API's server-sent events,
each `event: <type>` with its JSON, numbered by `sequence_number` from 0:
response.created, response.in_progress, then per output item its added, part, delta,
done events (output_item.added, content_part.added, output_text.delta ...,
output_text.done, content_part.done, output_item.done), and response.completed with the
whole response. An error after the stream started is one `error` event, which ends it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import msgspec

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.responses_output import OutputItems
from gateway.outputs import RequestOutput

#: The response object, given the final output (None: still in progress).
MakeResponse = Callable[[RequestOutput | None], dict[str, Any]]
#: Token ids and their engine log-probabilities -> the output text's `logprobs` entries.
TokenLogprobs = Callable[[list[int], list[Any] | None], list[dict[str, Any]]]


async def response_events(outputs: AsyncGenerator[tuple[int, RequestOutput], None],
                          items: OutputItems, make_response: MakeResponse,
                          logprobs: TokenLogprobs | None = None
                          ) -> AsyncGenerator[dict[str, Any], None]:
    """The events of one response, from the engine's outputs of its one request
    (`logprobs`: how to show the tokens' log-probabilities, when the request asks)."""
    in_progress = make_response(None)
    yield {"type": "response.created", "response": in_progress}
    yield {"type": "response.in_progress", "response": in_progress}
    last: RequestOutput | None = None
    async with aclosing(outputs):
        async for _, output in outputs:
            last = output
            if logprobs is not None and output.delta_token_ids:
                items.add_logprobs(logprobs(output.delta_token_ids, output.delta_logprobs))
            if output.delta_text or output.finished:
                for event in items.feed(output.delta_text, output.finished):
                    yield event
    assert last is not None  # the stream opened with an output
    for event in items.finish(is_truncated=last.finish_reason == "length"):
        yield event
    yield {"type": "response.completed", "response": make_response(last)}


async def sse_events(events: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[bytes]:
    """Number and encode `events` as server-sent events."""
    sequence_number = 0
    async with aclosing(events):
        try:
            async for event in events:
                yield _encode({**event, "sequence_number": sequence_number})
                sequence_number += 1
        except OpenAIError as exc:
            yield _encode({"type": "error", "code": exc.code, "message": exc.message,
                           "param": exc.param, "sequence_number": sequence_number})


def _encode(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) \
        + b"\n\n"
