"""Logging set-up shared by every gateway process.

Two formats (`GATEWAY_LOG_FORMAT`, or `gateway serve --log-format`): text lines, or one
JSON object per line for log shippers. A line logged while the front end handles a request
carries that request's id (the `X-Request-Id` the client sees): in the JSON field
`request_id`, and as `[req ID]` in a text line.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

from gateway import envs

_TEXT_FORMAT = "%(levelname)s %(asctime)s [%(name)s pid=%(process)d]%(request_tag)s %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"
_configured = False

#: The id of the HTTP request this task is serving (set by the request-id middleware).
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "gateway_request_id", default=None)


class _RequestIdFilter(logging.Filter):
    """Adds `request_id` (or None) and `request_tag` (" [req ID]" or "") to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", None) or current_request_id.get()
        record.request_id = request_id
        record.request_tag = f" [req {request_id}]" if request_id else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, pid, message, request_id, and the
    exception's traceback text when there is one. Times are UTC."""

    converter = time.gmtime  # type: ignore[assignment]  # typeshed: gmtime takes an optional float

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "pid": record.process,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def make_formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    return logging.Formatter(_TEXT_FORMAT, datefmt=_DATE_FORMAT)


def init_logger(name: str) -> logging.Logger:
    """Return the logger `name`, configuring the `gateway` root logger once per process."""
    global _configured
    if not _configured:
        root = logging.getLogger("gateway")
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(make_formatter(envs.log_format()))
            handler.addFilter(_RequestIdFilter())
            root.addHandler(handler)
        root.setLevel(envs.logging_level())
        root.propagate = True
        _configured = True
    return logging.getLogger(name)


def set_log_format(log_format: str) -> None:
    """Switch this process's gateway handlers to `log_format` (the CLI calls it once the
    flags are parsed; child processes read GATEWAY_LOG_FORMAT at their start)."""
    init_logger("gateway")
    for handler in logging.getLogger("gateway").handlers:
        handler.setFormatter(make_formatter(log_format))


def uvicorn_log_config(log_format: str) -> dict[str, Any]:
    """uvicorn's logging configuration in the gateway's format, so its access and error
    lines read like every other line (and carry the request id)."""
    formatter = ({"()": JsonFormatter} if log_format == "json"
                 else {"format": _TEXT_FORMAT, "datefmt": _DATE_FORMAT})
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr",
               "formatter": "gateway", "filters": ["request_id"]}
    return {
        "version": 1, "disable_existing_loggers": False,
        "filters": {"request_id": {"()": _RequestIdFilter}},
        "formatters": {"gateway": formatter},
        "handlers": {"default": handler},
        "loggers": {name: {"handlers": ["default"], "level": "INFO", "propagate": False}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }
