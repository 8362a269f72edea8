from __future__ import annotations

import importlib

import pytest


@pytest.fixture(autouse=True)
def _keep_process_role(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Worker names its process "worker-0" when nothing named it: undo that per test."""
    # (gateway.plugins.load_report, the attribute, is the LoadReport: import the module itself.)
    report_module = importlib.import_module("gateway.plugins.load_report")
    monkeypatch.setattr(report_module, "_process_role", report_module._process_role)
