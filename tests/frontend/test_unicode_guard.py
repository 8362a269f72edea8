"""The lone-surrogate scan of raw JSON bodies against Python's own parser: a body is flagged
exactly when a string it parses to cannot be encoded as UTF-8."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.frontend.http.unicode_guard import has_lone_surrogate_escape

#: Lone halves, a pair, and the look-alikes that are text: backslashes typed before "u".
PIECES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d\ude00", "\\",
                          "\\\\", "\\ud800", "\\udc00", "u", "d800", "x"])
TEXTS = st.lists(PIECES, max_size=8).map("".join)


def _is_text(body: bytes) -> bool:
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@given(text=TEXTS, upper=st.booleans())
@settings(max_examples=500, deadline=None, derandomize=True, database=None)
def test_scan_flags_exactly_the_bodies_that_are_not_text(text, upper):
    body = json.dumps({"prompt": text}).encode()
    if upper:  # encoders differ in the case of the hex digits
        body = body.replace(b"\\ud", b"\\uD")
    assert has_lone_surrogate_escape(body) is not _is_text(body), body


@pytest.mark.parametrize(("body", "flagged"), [
    (rb'{"p": "\ud83d\ude00"}', False),  # a pair: an escaped emoji
    (rb'{"p": "\\ud800"}', False),  # a typed backslash, then the text "ud800"
    (rb'{"p": "\\ud800\udc00"}', True),  # ... and then a lone low half
    (rb'{"p": "\\\ud800"}', True),  # an escaped backslash, then a lone high half
    (rb'{"p": "\uDBFF\uDFFF\uDFFF"}', True),  # a pair, then a lone low half
])
def test_scan_reads_escapes_as_a_json_parser_does(body, flagged):
    assert has_lone_surrogate_escape(body) is flagged
