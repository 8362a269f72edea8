"""Usage records for billing: one JSON line per finished request (a stat-logger plugin).

    {"request_id": "cmpl-…", "model": "tiny", "prompt_tokens": 12, "completion_tokens": 40,
     "total_tokens": 52, "finish_reason": "length", "latency_s": 0.412, "queued_s": 0.001,
     "finished_at": "2026-01-31T12:00:00.123456+00:00", "engine": 0}

The file is named by GATEWAY_USAGE_RECORDS_FILE; unset, the plugin logs one WARNING and
writes nothing. Lines are appended with one `write` per engine step (O_APPEND), so several
server processes may share the file and a reader never sees half a line.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from typing import Any

from gateway.plugins import StatLoggerBase

ENV_VAR = "GATEWAY_USAGE_RECORDS_FILE"

logger = logging.getLogger("gateway.usage_records")


class UsageRecordLogger(StatLoggerBase):
    """Made once per engine in the front end, beside the built-in stat loggers."""

    def __init__(self, config: Any, engine_index: int = 0) -> None:
        super().__init__(config, engine_index)
        self.model = config.model.served_model_name or config.model.model
        self.path = os.environ.get(ENV_VAR) or None
        self._fd: int | None = None
        if self.path is None:
            logger.warning("%s is not set: usage records are not written.", ENV_VAR)
        else:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int = 0) -> None:
        """Called every engine step: append the requests that finished in it."""
        if self._fd is None or iteration_stats is None or not iteration_stats.finished_requests:
            return
        now = datetime.datetime.now(datetime.UTC).isoformat()
        lines = "".join(json.dumps(self._usage(r, now, engine_idx)) + "\n"
                        for r in iteration_stats.finished_requests)
        os.write(self._fd, lines.encode())

    def _usage(self, request: Any, finished_at: str, engine_idx: int) -> dict[str, Any]:
        return {"request_id": request.request_id, "model": self.model,
                "prompt_tokens": request.num_prompt_tokens,
                "completion_tokens": request.num_generation_tokens,
                "total_tokens": request.num_prompt_tokens + request.num_generation_tokens,
                "finish_reason": request.finish_reason,
                "latency_s": round(request.e2e_latency, 6),
                "queued_s": round(request.queued_time, 6),
                "finished_at": finished_at, "engine": engine_idx}

    def log_engine_initialized(self) -> None:
        """Called once after the engine's handshake: say where the records go."""
        if self.path is not None:
            logger.info("Usage records of %s go to %s.", self.model, self.path)

    def log(self) -> None:
        """Nothing to flush: each step's lines are written at once."""
