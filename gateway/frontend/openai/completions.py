"""POST /v1/completions (task `generate`; API-server process): prompts (text or token ids) in,
text out, whole or streamed as SSE. A list of prompts gives one choice per prompt, `n` each, in
order.

`echo` puts the prompt before the completion; with `logprobs` the prompt's tokens get
theirs too (the first one `null`), and `max_tokens: 0` then returns the prompt alone, the
request lm-eval-harness sends to score a text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.http.json_body import JSONBodyRoute
from gateway.frontend.http.responses import JSONResponse
from gateway.frontend.openai import logprobs as lp
from gateway.frontend.openai.fanout import Choice, open_streams, plan_choices, run_to_end
from gateway.frontend.openai.generation import STREAM_RESPONSES, SSEResponse, sse_body
from gateway.frontend.openai.ignored_fields import report_ignored
from gateway.frontend.openai.protocol import CompletionRequest
from gateway.frontend.openai.sampling import (
    check_num_seqs,
    check_token_ids,
    check_unsupported,
    resolve_max_tokens,
    to_sampling_params,
)
from gateway.frontend.openai.serving import ServingOptions
from gateway.frontend.openai.structured_outputs import structured_outputs_of
from gateway.frontend.prompt_work import check_text_length, off_loop
from gateway.frontend.server_state import server_state
from gateway.lora_request import LoRARequest
from gateway.outputs import RequestOutput
from gateway.plugins import EngineClient

router = APIRouter(route_class=JSONBodyRoute)
ROUTE = "/v1/completions"

Prompt = str | list[int] | list[str] | list[list[int]]


@dataclass
class _Batch:
    """What the response needs of the request, beyond the engine's outputs."""

    body: CompletionRequest
    request_id: str
    prompts: list[list[int]]
    prompt_texts: list[str]  # for echo
    choices: list[Choice]
    text_of: lp.TokenText

    @property
    def echo_only(self) -> bool:  # echo with max_tokens 0: the prompt, nothing generated
        return self.body.echo and self.body.max_tokens == 0


@router.post(ROUTE, responses=STREAM_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's completions API."""
    state = server_state(request)
    engine_client, options = state.engine_client, state.serving_options
    lora = await state.lora_adapters.resolve(body.model)
    check_unsupported(body, options.max_n)
    check_num_seqs(len(_prompt_list(body.prompt)), body.n, options.max_seqs_per_request,
                   options.max_num_queued_reqs)
    for text in _prompt_list(body.prompt):  # each prompt of a batch has its own context
        if isinstance(text, str):  # token ids are counted by the engine, not read here
            check_text_length(text, engine_client.max_model_len, "prompt")
    batch = await off_loop(_plan, body, engine_client, options, lora)
    response_id = f"cmpl-{body.request_id}" if body.request_id else batch.request_id
    header = {"id": response_id, "object": "text_completion", "created": int(time.time()),
              "model": body.model if lora is not None else engine_client.model_name}
    if body.stream:
        outputs = await open_streams(engine_client, request, batch.choices)
        stream = body.stream_options
        return report_ignored(body, SSEResponse(sse_body(_chunks(
            outputs, header, batch, include_usage=bool(stream and stream.include_usage),
            continuous_usage=bool(stream and stream.continuous_usage_stats)))), ROUTE)
    finals = await run_to_end(engine_client, request, batch.choices)
    choices = [_choice(batch, c, final, final.token_ids, final.logprobs, first=True,
                       text=final.text, offset=0, finished=True)
               for c, final in zip(batch.choices, finals)]
    return report_ignored(body, JSONResponse(
        {**header, "choices": choices, "usage": _usage(batch, finals)}), ROUTE)


def _plan(body: CompletionRequest, engine_client: EngineClient, options: ServingOptions,
          lora: LoRARequest | None = None) -> _Batch:
    if body.max_tokens == 0 and not body.echo:
        raise OpenAIError(400, "max_tokens must be at least 1 (0 only with echo).",
                          param="max_tokens")
    tokenizer = engine_client.tokenizer
    prompts = [_truncate(ids, body.truncate_prompt_tokens, engine_client.max_model_len)
               for ids in prompts_to_token_ids(body.prompt, tokenizer, body.add_special_tokens)]
    # echo with logprobs: the prompt's logprobs too. Echo alone generates one token and
    # drops it (vLLM's way), so the engine never runs a request with nothing to sample.
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(body.logprobs, prompt_logprobs or 0)
    params = []
    for ids in prompts:
        max_tokens = resolve_max_tokens(1 if body.max_tokens == 0 else body.max_tokens,
                                        len(ids), engine_client.max_model_len, "prompt")
        params.append(to_sampling_params(
            body, max_tokens, tokenizer.vocab_size, tokenizer=tokenizer,
            defaults=options.sampling_defaults, logprobs=body.logprobs,
            prompt_logprobs=prompt_logprobs))
        params[-1].structured_outputs = structured_outputs_of(body, options.spec_limits)
        params[-1].lora_request = lora
    texts = [_prompt_text(p, ids, tokenizer) for p, ids in zip(_prompt_list(body.prompt),
                                                                prompts)]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    choices = plan_choices(request_id, prompts, params, body.n)
    text_of = lp.TokenText(tokenizer, body.return_tokens_as_token_ids)
    return _Batch(body, request_id, prompts, texts, choices, text_of)


def _prompt_list(prompt: Prompt) -> list[Any]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def prompts_to_token_ids(prompt: Prompt, tokenizer: Any, add_special_tokens: bool = True
                         ) -> list[list[int]]:
    """Every prompt's token ids (a string, token ids, or a list of either)."""
    prompts = _prompt_list(prompt)
    if not prompts:
        raise OpenAIError(400, "The prompt list is empty.", param="prompt")
    result = []
    for item in prompts:
        if isinstance(item, str):
            token_ids: list[int] = tokenizer.encode(item, add_special_tokens=add_special_tokens)
        else:
            token_ids = list(item)
            check_token_ids(token_ids, tokenizer.vocab_size, "prompt")
        if not token_ids:
            raise OpenAIError(400, "The prompt is empty.", param="prompt")
        result.append(token_ids)
    return result


def _truncate(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: the context's)."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len
    if not 1 <= keep <= max_model_len:
        raise OpenAIError(400, f"truncate_prompt_tokens must be -1 or between 1 and the "
                          f"context length {max_model_len}, got {keep}.",
                          param="truncate_prompt_tokens")
    return token_ids[-keep:]


def _prompt_text(prompt: Any, token_ids: list[int], tokenizer: Any) -> str:
    if isinstance(prompt, str) and len(token_ids) == len(tokenizer.encode(prompt)):
        return prompt
    return str(tokenizer.decode(token_ids))


def _choice(batch: _Batch, choice: Choice, output: RequestOutput, token_ids: list[int],
            entries: list[Any] | None, *, first: bool, text: str, offset: int,
            finished: bool) -> dict[str, Any]:
    """One choice (or one streamed delta of it): `token_ids`/`entries` are the new tokens
    and their logprobs; the `first` delta carries the echo and the prompt logprobs;
    `offset` is where the text starts."""
    body = batch.body
    echo = first and body.echo
    prompt = batch.prompts[choice.prompt_index]
    if batch.echo_only:
        token_ids, entries, text = [], [], ""
    logprobs = None
    if body.logprobs is not None:
        logprobs = lp.completion_logprobs(batch.text_of, token_ids, entries or [],
                                          body.logprobs, offset)
        if echo:
            echoed = lp.completion_logprobs(batch.text_of, prompt,
                                            output.prompt_logprobs or [None] * len(prompt),
                                            body.logprobs, 0)
            shift = len(batch.prompt_texts[choice.prompt_index])
            logprobs["text_offset"] = [o + shift for o in logprobs["text_offset"]]
            logprobs = lp.merge_completion_logprobs(echoed, logprobs)
    result: dict[str, Any] = {
        "index": choice.index,
        "text": (batch.prompt_texts[choice.prompt_index] if echo else "") + text,
        "logprobs": logprobs,
        "finish_reason": output.finish_reason if finished else None,
        "stop_reason": output.stop_reason if finished else None}
    if body.return_token_ids:
        result["token_ids"] = list(token_ids)
        if first:
            result["prompt_token_ids"] = list(prompt)
    if first and body.prompt_logprobs is not None and output.prompt_logprobs is not None:
        result["prompt_logprobs"] = lp.prompt_logprobs_json(batch.text_of, prompt,
                                                            output.prompt_logprobs)
    return result


def _usage(batch: _Batch, outputs: Sequence[RequestOutput | None]) -> dict[str, int]:
    """Summed over the choices; each prompt counted once (vLLM's way)."""
    prompt = sum(len(ids) for ids in batch.prompts)
    completion = 0 if batch.echo_only else sum(len(o.token_ids) for o in outputs if o)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def _chunks(outputs: AsyncGenerator[tuple[int, RequestOutput], None],
                  header: dict[str, Any], batch: _Batch, *, include_usage: bool,
                  continuous_usage: bool) -> AsyncGenerator[dict[str, Any], None]:
    latest: list[RequestOutput | None] = [None] * len(batch.choices)
    offsets = [0] * len(batch.choices)  # text sent so far, for text_offset
    started = [False] * len(batch.choices)
    async with aclosing(outputs):
        async for index, output in outputs:
            latest[index] = output
            first = not started[index]
            if not (output.delta_text or output.finished or (first and batch.body.echo)
                    or (output.delta_logprobs and not batch.echo_only)):
                continue
            started[index] = True
            choice = _choice(batch, batch.choices[index], output, output.delta_token_ids,
                             output.delta_logprobs, first=first, text=output.delta_text,
                             offset=offsets[index], finished=output.finished)
            offsets[index] += len(choice["text"])
            chunk = {**header, "choices": [choice]}
            if include_usage:
                chunk["usage"] = _usage(batch, latest) if continuous_usage else None
            yield chunk
    if include_usage:
        yield {**header, "choices": [], "usage": _usage(batch, latest)}
