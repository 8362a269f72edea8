"""Request logs (front end): vLLM's `--enable-log-requests`, `--enable-log-outputs` and
`--max-log-len`.

Every generation and pooling request passes through the engine client, so one place logs
them all, plugin routes included. A line names the engine's request id in its text and
carries the HTTP request's id (`X-Request-Id`) as its `request_id`; the prompt and output text
and their token ids are cut to `max_log_len` (characters, ids). Nothing here sees headers,
so an API key can never reach these lines.
"""

from __future__ import annotations

from typing import Any

from gateway.logger import current_request_id, init_logger

logger = init_logger("gateway.requests")


class RequestLogger:
    def __init__(self, max_log_len: int | None = None, log_outputs: bool = False) -> None:
        self.max_log_len = max_log_len
        self.log_outputs = log_outputs

    def _cut(self, value: Any) -> Any:
        return value if self.max_log_len is None else value[:self.max_log_len]

    def log_inputs(self, request_id: str, prompt: str, prompt_token_ids: list[int],
                   params: Any) -> None:
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, "
                    "prompt tokens: %d.", request_id, self._cut(prompt), params,
                    self._cut(prompt_token_ids), len(prompt_token_ids),
                    extra=_ids(request_id))

    def log_output(self, request_id: str, text: str, token_ids: list[int],
                   finish_reason: str | None, num_prompt_tokens: int) -> None:
        if not self.log_outputs:
            return
        logger.info("Finished request %s: finish_reason: %s, output: %r, output_token_ids: "
                    "%s, prompt tokens: %d, output tokens: %d.", request_id, finish_reason,
                    self._cut(text), self._cut(token_ids), num_prompt_tokens, len(token_ids),
                    extra=_ids(request_id))


def _ids(engine_request_id: str) -> dict[str, str]:
    """The line's request id: the HTTP request's (what the client sees in X-Request-Id),
    else (offline use) the engine's."""
    return {"request_id": current_request_id.get() or engine_request_id}
