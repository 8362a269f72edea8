"""One HTTP request, several engine requests: `n` choices per prompt and batched prompts
(API-server process).

Each choice is its own engine request (vLLM's parallel sampling; choice `i` of a seeded
request samples with `seed + i`). The whole fan-out is admitted at once (the engine
client's `reserve`), then runs in a window: at most `request_share` (half of
--max-num-seqs) of its choices are in the engine at a time, the next sent as one ends, so
another client's request waits behind at most one window of it, and a request's tasks,
streams and aborts are bounded. Streamed, the outputs are merged, tagged with their index.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from fastapi import Request

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.generation import (
    _last_output,
    open_stream,
    start_stream,
    until_disconnected,
)
from gateway.outputs import RequestOutput
from gateway.plugins import EngineClient
from gateway.sampling_params import InvalidParameterError, SamplingParams

T = TypeVar("T")


@dataclass
class Choice:
    """One engine request behind one choice of the response."""

    index: int
    prompt_index: int  # which prompt of a batch it continues
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice `index` of `params.n`: one sample, the seed offset by the index."""
    seed = None if params.seed is None else params.seed + index
    try:
        return msgspec.structs.replace(params, n=1, seed=seed)
    except InvalidParameterError as exc:
        raise OpenAIError(400, str(exc), param=exc.param) from exc


def plan_choices(request_id: str, prompts: list[list[int]], params: list[SamplingParams],
                 n: int) -> list[Choice]:
    """Choices in response order: prompt by prompt, `n` each."""
    choices = []
    for prompt_index, (prompt, prompt_params) in enumerate(zip(prompts, params)):
        for sample in range(n):
            index = prompt_index * n + sample
            choice_id = request_id if len(prompts) * n == 1 else f"{request_id}-{index}"
            choices.append(Choice(index, prompt_index, prompt, child_params(prompt_params,
                                                                             sample), choice_id))
    return choices


def request_share(engine_client: EngineClient) -> int:
    """How many of one request's choices may be in the engine at once: half of
    --max-num-seqs (at least one), so others' requests always find room in the batch."""
    return max(1, engine_client.config.scheduler.max_num_seqs // 2)


async def run_to_end(engine_client: EngineClient, request: Request, choices: list[Choice]
                     ) -> list[RequestOutput]:
    """Every choice's final output, in order (a client that goes away aborts them all)."""
    request_ids = [c.request_id for c in choices]
    engine_client.reserve(request_ids)
    try:
        _note_parents(engine_client, choices)
        return await until_disconnected(request, _all_outputs(
            engine_client, choices, request_share(engine_client)))
    finally:
        engine_client.release(request_ids)


def _note_parents(engine_client: EngineClient, choices: list[Choice]) -> None:
    """Tell the engine client which choices belong to one prompt (`vllm:request_params_n`)."""
    by_prompt: dict[int, list[str]] = {}
    for choice in choices:
        by_prompt.setdefault(choice.prompt_index, []).append(choice.request_id)
    for request_ids in by_prompt.values():
        engine_client.add_parent_request(request_ids)


async def _all_outputs(engine_client: EngineClient, choices: list[Choice], share: int
                       ) -> list[RequestOutput]:
    return await run_in_window([functools.partial(
        _last_output, engine_client, c.prompt_token_ids, c.params, c.request_id)
        for c in choices], share)


async def run_in_window(jobs: list[Callable[[], Awaitable[T]]], share: int) -> list[T]:
    """Every job's result, in order, running `share` at a time: the next starts as one
    ends. The first failure cancels the others and is raised."""
    results: list[T | None] = [None] * len(jobs)
    running: dict[asyncio.Future[T], int] = {}
    num_started = 0
    try:
        while num_started < len(jobs) or running:
            while num_started < len(jobs) and len(running) < share:
                running[asyncio.ensure_future(jobs[num_started]())] = num_started
                num_started += 1
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                results[running.pop(task)] = task.result()
    finally:  # one failed or the client left: the others stop too
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    return results  # type: ignore[return-value]  # every one set: none failed


async def open_streams(engine_client: EngineClient, request: Request, choices: list[Choice]
                       ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Start the first window of streams (each has answered once, so an error the engine
    reports at once is still an HTTP status), then merge them: (choice index, output)
    pairs; the later choices start as earlier ones end."""
    request_ids = [c.request_id for c in choices]
    engine_client.reserve(request_ids)
    release = functools.partial(engine_client.release, request_ids)
    try:
        _note_parents(engine_client, choices)
        first = choices[:request_share(engine_client)]
        opened = await asyncio.gather(
            *(open_stream(engine_client, request, c.prompt_token_ids, c.params, c.request_id)
              for c in first), return_exceptions=True)
        streams = [s for s in opened if not isinstance(s, BaseException)]
        failure = next((s for s in opened if isinstance(s, BaseException)), None)
        if failure is not None:
            for stream in streams:
                await stream.aclose()
            raise failure
    except BaseException:
        release()
        raise
    merged = _merge(engine_client, choices, streams, release)  # type: ignore[arg-type]
    weakref.finalize(merged, release)  # a response that never starts: released when dropped
    return merged


async def _merge(engine_client: EngineClient, choices: list[Choice],
                 streams: list[AsyncGenerator[RequestOutput, None]],
                 release: Callable[[], None]
                 ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    if len(choices) == 1:  # the common case: no tasks in between
        try:
            async with _closing(streams):
                async for output in streams[0]:
                    yield choices[0].index, output
        finally:
            release()
        return
    pending: dict[asyncio.Future[RequestOutput], int] = {}
    opened = list(streams)  # position in `choices` -> its stream, once started
    try:
        async with _closing(opened, pending):
            for position, stream in enumerate(opened):
                pending[asyncio.ensure_future(anext(stream))] = position
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: pending[t]):
                    position = pending.pop(task)
                    try:
                        output = task.result()
                    except StopAsyncIteration:  # this choice ended: the next one starts
                        if len(opened) < len(choices):
                            opened.append(_later_stream(engine_client, choices[len(opened)]))
                            pending[asyncio.ensure_future(anext(opened[-1]))] = \
                                len(opened) - 1
                        continue
                    yield choices[position].index, output
                    pending[asyncio.ensure_future(anext(opened[position]))] = position
    finally:
        release()


async def _later_stream(engine_client: EngineClient, choice: Choice
                        ) -> AsyncGenerator[RequestOutput, None]:
    """A choice started while the response streams: its outputs, errors as OpenAIError."""
    stream = await start_stream(engine_client, choice.prompt_token_ids, choice.params,
                                choice.request_id)
    async with aclosing(stream):
        async for output in stream:
            yield output


class _closing:
    """Cancel the in-flight reads, then close every stream (which aborts its request)."""

    def __init__(self, streams: list[AsyncGenerator[RequestOutput, None]],
                 pending: dict[asyncio.Future[RequestOutput], int] | None = None) -> None:
        self.streams, self.pending = streams, pending if pending is not None else {}

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc_info: object) -> None:
        for task in self.pending:
            task.cancel()
        for task in self.pending:
            with suppress(BaseException):
                await task
        for stream in self.streams:
            await stream.aclose()
