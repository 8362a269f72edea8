"""Turning the engine core's token outputs into per-request text outputs (front-end
process): each request's state, its detokenizer and stop strings, and the `RequestOutput`
(gateway/outputs.py) its caller receives for each step."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway.frontend.outputs.detokenizer import Decoder, IncrementalDetokenizer
from gateway.messages import EngineCoreOutput, TokenLogprobs
from gateway.outputs import RequestOutput
from gateway.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @classmethod
    def make(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             tokenizer: Decoder) -> RequestState:
        return cls(request_id, prompt_token_ids, params,
                   IncrementalDetokenizer(tokenizer, prompt_token_ids, params),
                   logprobs=[] if params.logprobs is not None else None)

    def process(self, output: EngineCoreOutput) -> RequestOutput:
        """Apply one engine output. A stop string found here finishes the request with
        finish_reason "stop" while the engine still runs it: the caller aborts it there."""
        self.token_ids.extend(output.new_token_ids)
        finish_reason: str | None = output.finish_reason
        stop_reason: str | int | None = output.stop_reason
        # EOS or a stop token: its text is not output, unless the client asked for it.
        skip_last = finish_reason == "stop" and not self.params.include_stop_str_in_output
        delta_logprobs = self._add_logprobs(output)
        stop_string = self.detokenizer.update(output.new_token_ids, skip_last=skip_last)
        if stop_string is not None:
            finish_reason, stop_reason = "stop", stop_string
        self.finished = finish_reason is not None
        delta_text = self.detokenizer.take_delta(self.finished)
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            text=self.detokenizer.output_text[:self.detokenizer.num_sent_chars],
            delta_text=delta_text,
            token_ids=list(self.token_ids), delta_token_ids=list(output.new_token_ids),
            finished=self.finished, finish_reason=finish_reason, stop_reason=stop_reason,
            error=output.error, error_kind=output.error_kind, error_param=output.error_param,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            delta_logprobs=delta_logprobs, prompt_logprobs=self.prompt_logprobs)

    def _add_logprobs(self, output: EngineCoreOutput) -> list[TokenLogprobs] | None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None \
                and output.new_token_ids:
            # The first token has none; so has any prompt token whose KV the engine
            # found cached and did not compute (the entries are the prompt's tail).
            entries = output.prompt_logprobs or []
            missing = len(self.prompt_token_ids) - len(entries)
            self.prompt_logprobs = [None] * missing + list(entries)
        if self.logprobs is None:
            return None
        delta = list(output.new_logprobs or [])
        self.logprobs += delta
        return delta
