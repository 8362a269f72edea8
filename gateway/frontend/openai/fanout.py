"""One HTTP request, several engine requests: `n` choices per prompt and batched prompts
(API-server process).

Each choice is its own engine request (vLLM's parallel sampling): choice `i` of a seeded
request gets the seed `seed + i`, as vLLM derives its child seeds, so the samples are
reproducible and differ from each other. Non-streaming, the choices are awaited together;
streaming, their outputs are merged as they come, each tagged with its choice index.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import suppress
from dataclasses import dataclass

import msgspec
from fastapi import Request

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.generation import _last_output, open_stream, until_disconnected
from gateway.outputs import RequestOutput
from gateway.plugins import EngineClient
from gateway.sampling_params import InvalidParameterError, SamplingParams


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


async def run_to_end(engine_client: EngineClient, request: Request, choices: list[Choice]
                     ) -> list[RequestOutput]:
    """Every choice's final output, in order (a client that goes away aborts them all)."""
    _note_parents(engine_client, choices)
    return await until_disconnected(request, _all_outputs(engine_client, choices))


def _note_parents(engine_client: EngineClient, choices: list[Choice]) -> None:
    """Tell the engine client which choices belong to one prompt (`vllm:request_params_n`)."""
    by_prompt: dict[int, list[str]] = {}
    for choice in choices:
        by_prompt.setdefault(choice.prompt_index, []).append(choice.request_id)
    for request_ids in by_prompt.values():
        engine_client.add_parent_request(request_ids)


async def _all_outputs(engine_client: EngineClient, choices: list[Choice]
                       ) -> list[RequestOutput]:
    tasks = [asyncio.ensure_future(_last_output(engine_client, c.prompt_token_ids, c.params,
                                                c.request_id)) for c in choices]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # one failed or the client left: the others stop too
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def open_streams(engine_client: EngineClient, request: Request, choices: list[Choice]
                       ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Start every choice's stream (each has answered once, so an error the engine reports
    at once is still an HTTP status), then merge them: (choice index, output) pairs."""
    _note_parents(engine_client, choices)
    opened = await asyncio.gather(
        *(open_stream(engine_client, request, c.prompt_token_ids, c.params, c.request_id)
          for c in choices), return_exceptions=True)
    streams = [s for s in opened if not isinstance(s, BaseException)]
    failure = next((s for s in opened if isinstance(s, BaseException)), None)
    if failure is not None:
        for stream in streams:
            await stream.aclose()
        raise failure
    return _merge([c.index for c in choices], streams)  # type: ignore[arg-type]


async def _merge(indices: list[int], streams: list[AsyncGenerator[RequestOutput, None]]
                 ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    if len(streams) == 1:  # the common case: no tasks in between
        async with _closing(streams):
            async for output in streams[0]:
                yield indices[0], output
        return
    pending: dict[asyncio.Future[RequestOutput], int] = {}
    async with _closing(streams, pending):
        for position, stream in enumerate(streams):
            pending[asyncio.ensure_future(anext(stream))] = position
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                position = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                yield indices[position], output
                pending[asyncio.ensure_future(anext(streams[position]))] = position


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
