"""POST /v1/summarize: summarize a text with the served model (an endpoint plugin).

An example of a plugin that generates through the engine: `init_state` receives the engine
client, and the route renders a prompt with the model's chat template, generates, and
answers JSON. Needs a model with the `generate` task, so `required_tasks` says so and the
server skips this plugin (with a log line) on an embedding model.

The route is `async def` (it awaits the engine), so nothing in it may block: every other
request of the server waits while it does. Rendering and tokenizing a long text is CPU
work, so it runs in the thread pool (`run_in_threadpool`); a route with no `await` at all
can simply be a plain `def`, which FastAPI runs in the thread pool by itself.

Enable it with `VLLM_PLUGINS=summarize` (endpoint plugins load only when named).
"""

from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from gateway.sampling_params import SamplingParams

INSTRUCTION = ("You summarize texts. Answer with a short summary of the user's text and "
               "nothing else.")


class SummarizeRequest(BaseModel):
    # strict: each field must have its documented JSON type (true is not a max_tokens of 1)
    model_config = ConfigDict(strict=True)

    text: str = Field(min_length=1, description="the text to summarize")
    max_tokens: int = Field(128, ge=1, description="the longest summary, in tokens")
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy (the same every time)")


class SummarizePlugin:
    """The endpoint plugin (the object the entry point's factory returns)."""

    name = "summarize"
    required_tasks: tuple[str, ...] | None = ("generate",)

    def __init__(self) -> None:
        self.engine_client: Any = None

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter(tags=["summarize"])
        router.add_api_route("/v1/summarize", self.summarize, methods=["POST"],
                             summary="Summarize a text with the served model")
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        self.engine_client = engine_client

    async def summarize(self, body: SummarizeRequest) -> dict[str, Any]:
        engine = self.engine_client
        # Off the event loop: a long text takes a while to tokenize.
        prompt_token_ids = await run_in_threadpool(self._prompt, body.text)
        if len(prompt_token_ids) + body.max_tokens > engine.max_model_len:
            raise HTTPException(400, f"The text is too long: {len(prompt_token_ids)} prompt "
                                f"tokens + max_tokens {body.max_tokens} exceed the model's "
                                f"context of {engine.max_model_len} tokens.")
        params = SamplingParams(temperature=body.temperature, max_tokens=body.max_tokens)
        request_id = f"summarize-{uuid.uuid4().hex}"
        final = None
        # Closing the generator (also when the client goes away) aborts the engine request.
        async with aclosing(engine.generate(prompt_token_ids, params, request_id)) as outputs:
            async for output in outputs:
                final = output
        if final is None or final.error:
            raise HTTPException(500, f"Generation failed for request {request_id}.")
        return {"id": request_id, "model": engine.model_name, "summary": final.text.strip(),
                "finish_reason": final.finish_reason,
                "usage": {"prompt_tokens": len(final.prompt_token_ids),
                          "completion_tokens": len(final.token_ids)}}

    def _prompt(self, text: str) -> list[int]:
        tokenizer = self.engine_client.tokenizer
        messages = [{"role": "system", "content": INSTRUCTION},
                    {"role": "user", "content": text}]
        try:
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError:  # a model without a chat template: a plain prompt
            return list(tokenizer.encode(f"{INSTRUCTION}\n\nText:\n{text}\n\nSummary:"))
        return list(tokenizer.encode(rendered, add_special_tokens=False))


def make_plugin() -> SummarizePlugin:
    """The `vllm.endpoint_plugins` entry point: a zero-argument factory."""
    return SummarizePlugin()
