"""The log filter's rules, line by line (the end-to-end check on a real server's log is in
tests/reliability/test_logs_and_labels.py)."""

from __future__ import annotations

import logging

import pytest

from gateway.frontend.http.log_redaction import SecretRedactionFilter, redact

KEY = "sk-unit-key-77"


@pytest.mark.parametrize(("line", "expected"), [
    ('"GET /v1/models?api_key=abc&x=1 HTTP/1.1" 200',
     '"GET /v1/models?api_key=[redacted]&x=1 HTTP/1.1" 200'),
    ("/x?a=1&key=s3cr3t", "/x?a=1&key=[redacted]"),
    ("/x?API-KEY=s3cr3t#frag", "/x?API-KEY=[redacted]#frag"),
    ("/x?access_token=t0k&token=t1", "/x?access_token=[redacted]&token=[redacted]"),
    ("/x?monkey=1&keys=2", "/x?monkey=1&keys=2"),
    ("[(b'authorization', b'Bearer abc'), (b'host', b'x')]",
     "[(b'authorization', b'[redacted]'), (b'host', b'x')]"),
    ("{'authorization': 'Basic dXNlcjpw', 'host': 'x'}",
     "{'authorization': '[redacted]', 'host': 'x'}"),
    ("Proxy-Authorization: Bearer abc", "Proxy-Authorization: [redacted]"),
    ("sent bearer abc.def to upstream", "sent bearer [redacted] to upstream"),
    (f"the key {KEY} in free text", "the key [redacted] in free text"),
    ("nothing secret here", "nothing secret here"),
])
def test_redact_hides_keys_tokens_and_credentials(line, expected):
    assert redact(line, [KEY]) == expected


@pytest.mark.parametrize(("msg", "args"), [
    ("headers: %s", ({"authorization": f"Bearer {KEY}"},)),
    ('%s - "%s %s HTTP/%s" %d', ("1.2.3.4:5", "GET", f"/v1/models?api_key={KEY}", "1.1", 200)),
    ("failed: %r", (ValueError(f"key={KEY}"),)),
])
def test_the_filter_redacts_message_arguments_and_keeps_their_shape(msg, args):
    record = logging.LogRecord("x", logging.INFO, __file__, 1, msg, args, None)
    assert SecretRedactionFilter([KEY]).filter(record)
    assert KEY not in record.getMessage()
    assert not isinstance(record.args, tuple) or len(record.args) == len(args)
