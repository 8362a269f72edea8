"""Fixtures of the reliability tests: the end-to-end fixtures of tests/frontend (the tiny
random model, the example endpoint plugins pip-installed into a folder), plus helpers to
read the Prometheus exposition of a running server."""

from __future__ import annotations

import re

from tests.frontend.conftest import example_plugins_site, tiny_model  # noqa: F401

_SAMPLE = re.compile(r'^(?P<name>[^\s{]+)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)', re.MULTILINE)


def metric(exposition: str, name: str, model_name: str) -> float:
    """The value of `name` for `model_name` in a /metrics text (one sample expected)."""
    values = [float(m["value"]) for m in _SAMPLE.finditer(exposition)
              if m["name"] == name and f'model_name="{model_name}"' in m["labels"]]
    assert len(values) == 1, (name, values)
    return values[0]
