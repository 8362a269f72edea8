"""The chat-template sandbox bounds a render's work: its text stops at the limit, and a
repetition or power past it is refused before it is made."""

from __future__ import annotations

import resource
import time

import pytest

from gateway.template_sandbox import (
    TemplateError,
    TemplateOutputError,
    render_template,
    start_helper,
)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("source", [
    "{{ 'x' * 1000000000 }}",
    "{{ 1000000000 * 'x' }}",
    "{{ [1, 2] * 1000000000 }}",
    "{% set s = 'abc' * 100000000 %}{{ s | length }}",  # made, even if never written
])
def test_a_repetition_past_the_limit_is_refused_before_it_is_made(source):
    before = _peak_rss_mib()
    started = time.monotonic()
    with pytest.raises(TemplateOutputError):
        render_template(source, {}, max_chars=32_768)
    assert time.monotonic() - started < 0.5
    assert _peak_rss_mib() - before < 50  # the gigabyte was never allocated


def test_the_text_stops_at_the_limit_while_it_is_written():
    with pytest.raises(TemplateOutputError, match="32768"):
        render_template("{% for i in range(100000) %}{{ 'abcdefgh' }}{% endfor %}", {},
                        max_chars=32_768)
    assert render_template("{{ 'x' * 10 }}{{ 2 ** 10 }}", {}, max_chars=32) == "x" * 10 + "1024"


def test_a_huge_power_is_refused():
    with pytest.raises(TemplateError, match="too large"):
        render_template("{{ 7 ** 100000000 }}", {})


def test_the_helper_job_renders_as_in_process():
    render = start_helper(None)
    assert render(["{{ messages[0].content }}!", {"messages": [{"content": "hi"}]}, 100]) \
        == "hi!"
