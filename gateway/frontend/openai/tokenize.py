"""POST /tokenize and POST /detokenize (vLLM's shapes), with the served model's tokenizer
(API-server process).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.http.json_body import JSONBodyRoute
from gateway.frontend.http.responses import JSONResponse
from gateway.frontend.openai.chat_template import render_chat
from gateway.frontend.openai.ignored_fields import report_ignored
from gateway.frontend.openai.protocol import DetokenizeRequest, TokenizeRequest
from gateway.frontend.openai.sampling import check_model, check_token_ids
from gateway.frontend.prompt_work import MAX_CHARS_PER_TOKEN, check_text_length, off_loop
from gateway.frontend.server_state import server_state

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """Token ids of a prompt, or of chat messages rendered with the chat template."""
    engine_client = server_state(request).engine_client
    check_model(body.model, engine_client.model_name)
    tokenizer = engine_client.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "Give exactly one of 'prompt' and 'messages'.",
                          param="prompt" if body.prompt is None else "messages")
    max_model_len = engine_client.max_model_len
    if body.messages is not None:  # counting the characters is work too: off the loop
        tokens = await off_loop(_checked_render, body.messages, tokenizer, max_model_len,
                                template=server_state(request).serving_options.chat_template,
                                add_generation_prompt=body.add_generation_prompt,
                                add_special_tokens=bool(body.add_special_tokens),
                                max_chars=MAX_CHARS_PER_TOKEN * max_model_len)
    else:
        check_text_length(body.prompt, max_model_len, "prompt")
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = list(await off_loop(tokenizer.encode, body.prompt or "",
                                     add_special_tokens=add_special))
    return report_ignored(body, JSONResponse(
        {"count": len(tokens), "max_model_len": engine_client.max_model_len, "tokens": tokens,
         "token_strs": None}), "/tokenize")


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    """The text of a list of token ids."""
    engine_client = server_state(request).engine_client
    check_model(body.model, engine_client.model_name)
    text = await off_loop(_decode, engine_client.tokenizer, body.tokens)
    return report_ignored(body, JSONResponse({"prompt": text}), "/detokenize")


def _checked_render(messages: list[Any], tokenizer: Any, max_model_len: int,
                    **options: Any) -> list[int]:
    check_text_length(messages, max_model_len, "messages")
    return render_chat(messages, tokenizer, **options)


def _decode(tokenizer: Any, tokens: list[int]) -> str:
    check_token_ids(tokens, tokenizer.vocab_size, "tokens")
    return str(tokenizer.decode(tokens))
