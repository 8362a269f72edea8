"""Secrets kept out of the API server's logs (API-server process).

`install_log_redaction(secrets)` adds one filter to every handler the server's log lines
go through (the gateway's, uvicorn's error and access logs, the root logger's, and
Python's last-resort handler that a plugin's own logger falls back to). Before a line is
written, `redact` replaces the secrets in it with "[redacted]".
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

REDACTED = "[redacted]"
_QUERY_SECRET = re.compile(
    r"(?P<name>[?&](?:api[_-]?key|key|access[_-]?token|token)=)[^&#\s\"']*", re.IGNORECASE)
_AUTH_HEADER = re.compile(
    r"(?P<name>\b(?:proxy-)?authorization[\"']?\s*[:=,]\s*(?:(?-i:b)?[\"'])?)(?:[^\"'\s,)}]+ ?)+",
    re.IGNORECASE)
_CREDENTIALS = re.compile(r"(?P<name>\b(?:bearer|basic)\s+)[^\s\"',)}]+", re.IGNORECASE)
_LOGGERS = ("", "gateway", "uvicorn", "uvicorn.error", "uvicorn.access")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with "[redacted]" in place of:
    - the value of a query parameter named `api_key`, `api-key`, `apikey`, `key`,
      `access_token` or `token` (the access log writes each request's query string);
    - the credentials of an `Authorization` or `Proxy-Authorization` header, and anything
      after `Bearer ` or `Basic ` (uvicorn's trace level writes headers; a plugin may too);
    - each of `secrets` (the server's own API keys), wherever it appears.
    """
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    text = _QUERY_SECRET.sub(rf"\g<name>{REDACTED}", text)
    text = _AUTH_HEADER.sub(rf"\g<name>{REDACTED}", text)
    return _CREDENTIALS.sub(rf"\g<name>{REDACTED}", text)


class SecretRedactionFilter(logging.Filter):
    """Redacts a record's message, its string arguments and its traceback in place (the
    argument tuple keeps its shape: uvicorn's access formatter unpacks it)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, dict):  # one mapping argument: redact the whole line
            record.msg, record.args = redact(record.getMessage(), self.secrets), None
        if isinstance(record.msg, str):
            record.msg = redact(record.msg, self.secrets)
        if isinstance(record.args, tuple):
            record.args = tuple(self._redacted(a) for a in record.args)
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, self.secrets)
        return True

    def _redacted(self, value: Any) -> Any:
        """A string argument redacted; any other argument as it is, unless its text holds
        a secret (then that text, redacted)."""
        if isinstance(value, str):
            return redact(value, self.secrets)
        if isinstance(value, int | float | bool) or value is None:
            return value
        text = str(value)
        cleaned = redact(text, self.secrets)
        return value if cleaned == text else cleaned


def install_log_redaction(secrets: Iterable[str] = ()) -> SecretRedactionFilter:
    """Add a SecretRedactionFilter to every handler of the server's loggers (call it after
    uvicorn configured its logging) and to Python's last-resort handler."""
    redaction = SecretRedactionFilter(secrets)
    handlers = [h for name in _LOGGERS for h in logging.getLogger(name).handlers]
    if logging.lastResort is not None:
        handlers.append(logging.lastResort)
    for handler in dict.fromkeys(handlers):
        for old in [f for f in handler.filters if isinstance(f, SecretRedactionFilter)]:
            handler.removeFilter(old)
        handler.addFilter(redaction)
    return redaction
