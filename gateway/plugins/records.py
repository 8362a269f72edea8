"""The per-process plugin load report: what was found, loaded, skipped or failed, here.

Every process keeps its own report (one record per entry point); the engine core and the
workers send theirs to the front end, which merges them for `GET /v1/plugins`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

# Outcomes, in the order an entry point can pass through them.
OUTCOMES = (
    "discovered",        # found in installed metadata, not loaded (yet) in this process
    "not-allowlisted",   # VLLM_PLUGINS leaves it out (or, endpoint group, is unset)
    "not-requested",     # IO processor group: the model config names no plugin
    "duplicate-name",    # same name earlier in the group from another distribution
    "malformed",         # the entry point's value is not "module[:attr]"
    "import-failed",     # importing the module or reading the attribute raised
    "loaded",            # imported; the object is in hand
    "called",            # general plugin: the function ran
    "call-failed",       # general plugin: the function raised (start-up stops)
    "factory-failed",    # endpoint plugin: the factory raised
    "invalid-plugin",    # the object does not meet its group's contract
    "skipped-tasks",     # endpoint plugin: required_tasks do not meet the model's tasks
    "attach-failed",     # endpoint plugin: attach_router raised
    "init-failed",       # endpoint plugin: init_state raised
    "attached",          # endpoint plugin: routes are served
    "active",            # platform plugin: activated (and the chosen platform)
    "inactive",          # platform plugin: returned None
    "selected",          # IO processor: the one the model config names
    "registered",        # LoRA resolver: a general plugin registered it (failures while
                         # resolving are counted as runtime errors)
)
FAILED_OUTCOMES = frozenset({"malformed", "import-failed", "call-failed", "factory-failed",
                             "invalid-plugin", "attach-failed", "init-failed"})

@dataclass
class PluginRecord:
    group: str
    name: str
    value: str
    distribution: str
    process_role: str
    pid: int
    outcome: str
    error: str | None = None
    load_time_s: float = 0.0
    detail: str | None = None
    #: Failures while serving (a route answering 5xx, a stat logger's method raising):
    #: how many, and the last one. The outcome stays: the plugin is still called.
    num_runtime_errors: int = 0
    runtime_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LoadReport:
    """The records of one process, one per (group, name, distribution); held by its
    `PluginProcess` (gateway.plugins.process), which names the process in each record."""

    def __init__(self, role: Callable[[], str] = lambda: "main") -> None:
        self._records: dict[tuple[str, str, str], PluginRecord] = {}
        self._role = role

    def record(self, group: str, name: str, value: str, distribution: str, outcome: str, *,
               error: str | None = None, load_time_s: float | None = None,
               detail: str | None = None) -> PluginRecord:
        assert outcome in OUTCOMES, outcome
        key = (group, name, distribution)
        rec = self._records.get(key)
        if rec is None:
            rec = PluginRecord(group, name, value, distribution, self._role(), os.getpid(),
                               outcome)
            self._records[key] = rec
        rec.outcome, rec.error, rec.detail = outcome, error, detail
        rec.process_role, rec.pid = self._role(), os.getpid()
        if load_time_s is not None:
            rec.load_time_s = load_time_s
        return rec

    def note_runtime_error(self, group: str, name: str, error: str) -> None:
        """Count a failure of a loaded plugin while serving (see PluginRecord)."""
        rec = self.get(group, name)
        if rec is not None:
            rec.num_runtime_errors += 1
            rec.runtime_error = error

    def records(self, group: str | None = None) -> list[PluginRecord]:
        return [r for r in self._records.values() if group is None or r.group == group]

    def get(self, group: str, name: str) -> PluginRecord | None:
        for rec in self._records.values():
            if rec.group == group and rec.name == name and rec.outcome != "duplicate-name":
                return rec
        return None

    def to_dicts(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self._records.values()]

    def clear(self) -> None:
        self._records.clear()


def failures(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["outcome"] in FAILED_OUTCOMES]
