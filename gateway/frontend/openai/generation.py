"""Driving one request through the engine client, for the HTTP routes (API-server process).

A client that goes away aborts its request in the engine: the engine client's `generate`
aborts when its consumer stops iterating, so every path here makes sure iteration stops
(the generator is closed) as soon as the client disconnects: the non-streaming wait races
the request against the disconnect, and the SSE response closes its body iterator however
the response ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing, suppress
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.frontend.engine_client.errors import EngineDeadError
from gateway.frontend.http.drain import ServerShuttingDownError
from gateway.frontend.http.errors import ClientDisconnected, OpenAIError
from gateway.logger import init_logger
from gateway.outputs import PoolingRequestOutput, RequestOutput
from gateway.plugins import EngineClient
from gateway.sampling_params import SamplingParams

logger = init_logger(__name__)

T = TypeVar("T")
DONE_EVENT = b"data: [DONE]\n\n"


def engine_error(output: RequestOutput | PoolingRequestOutput) -> OpenAIError | None:
    """The HTTP error for an output that finished with an engine-side error, else None."""
    if output.finish_reason != "error" and output.error is None:
        return None
    if output.error_kind == "invalid_request":
        return OpenAIError(400, output.error or "Invalid request.", param=output.error_param)
    logger.error("Engine error on request %s: %s", output.request_id, output.error)
    return OpenAIError(500, f"The engine failed on request {output.request_id}.",
                       code="engine_error")


def engine_dead_error(engine_client: EngineClient, exc: BaseException | None = None) -> OpenAIError:
    if isinstance(exc, ServerShuttingDownError):  # the drain time is over
        return OpenAIError(503, "The server is shutting down and ended this request; "
                           "retry on another replica.", code="shutting_down")
    reason = engine_client.dead_reason or "unknown reason"
    return OpenAIError(503, f"The engine is not running ({reason}); the server cannot "
                       "answer requests.", code="engine_dead")


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, unless the client disconnects first: then cancel it and raise
    ClientDisconnected."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read by the route already; the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def generate_to_end(engine_client: EngineClient, request: Request,
                          prompt_token_ids: list[int], params: SamplingParams,
                          request_id: str) -> RequestOutput:
    """Run a request to its end and return its last output (non-streaming routes)."""
    return await until_disconnected(
        request, _last_output(engine_client, prompt_token_ids, params, request_id))


async def _last_output(engine_client: EngineClient, prompt_token_ids: list[int],
                       params: SamplingParams, request_id: str) -> RequestOutput:
    last: RequestOutput | None = None
    try:
        async with aclosing(engine_client.generate(prompt_token_ids, params, request_id)
                            ) as outputs:
            async for output in outputs:
                last = output
    except EngineDeadError as exc:
        raise engine_dead_error(engine_client, exc) from exc
    if last is None:
        raise OpenAIError(500, f"The engine returned no output for request {request_id}.")
    error = engine_error(last)
    if error is not None:
        raise error
    return last


async def open_stream(engine_client: EngineClient, request: Request, prompt_token_ids: list[int],
                      params: SamplingParams, request_id: str
                      ) -> AsyncGenerator[RequestOutput, None]:
    """Start a streaming request and wait for its first output before the response starts,
    so that an error the engine reports at once (a bad parameter) still gets its HTTP
    status. Returns a generator of every output, the first one included."""
    return await until_disconnected(request, start_stream(engine_client, prompt_token_ids,
                                                          params, request_id))


async def start_stream(engine_client: EngineClient, prompt_token_ids: list[int],
                       params: SamplingParams, request_id: str
                       ) -> AsyncGenerator[RequestOutput, None]:
    """`open_stream` for a response already under way (it watches the disconnect): the
    request's first output awaited, then a generator of every output."""
    outputs = engine_client.generate(prompt_token_ids, params, request_id)
    try:
        first = await anext(outputs)
    except EngineDeadError as exc:
        await outputs.aclose()
        raise engine_dead_error(engine_client, exc) from exc
    except StopAsyncIteration:
        raise OpenAIError(500, f"The engine returned no output for request {request_id}."
                          ) from None
    except BaseException:
        await outputs.aclose()
        raise
    error = engine_error(first)
    if error is not None:
        await outputs.aclose()
        raise error
    return _chain(first, outputs, engine_client)


async def _chain(first: RequestOutput, rest: AsyncGenerator[RequestOutput, None],
                 engine_client: EngineClient) -> AsyncGenerator[RequestOutput, None]:
    async with aclosing(rest):
        yield first
        if first.finished:
            return
        try:
            async for output in rest:
                error = engine_error(output)
                if error is not None:
                    raise error
                yield output
        except EngineDeadError as exc:
            raise engine_dead_error(engine_client, exc) from exc


def usage_of(output: RequestOutput) -> dict[str, int]:
    """OpenAI's `usage` object for an output so far."""
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def sse_event(payload: Any) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def sse_body(chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[bytes]:
    """Encode `chunks` as SSE events and end with `data: [DONE]`. An error after the
    response started is sent as one `{"error": ...}` event before [DONE]."""
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield sse_event(chunk)
        except OpenAIError as exc:
            yield sse_event({"error": {"message": exc.message, "type": exc.type,
                                       "param": exc.param, "code": exc.code}})
    yield DONE_EVENT


#: The OpenAPI entry of a route that streams SSE when the request asks `stream: true`.
STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {200: {
    "description": "The answer: JSON, or with `stream: true` server-sent events ending "
    "with `data: [DONE]`.",
    # The schema of one event: a JSON chunk in `data`, or the final `[DONE]`.
    "content": {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                       "id": {"type": "string"}, "retry": {"type": "integer"}}}}}}}


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that closes its body iterator however it ends, so a
    client that disconnects mid-stream stops the engine request at once."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
