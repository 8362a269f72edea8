"""This process's plugin state: its role, its load report and the general-plugins flag.

One `PluginProcess` per process, made by `start_process(role)` as the first thing each
process the gateway creates does (the CLI, the engine core, each worker). Code that runs
before (or without) that call, such as a script using `gateway.LLM`, gets one named after
GATEWAY_PROCESS_ROLE, or "main". A child made by fork would inherit its parent's object,
so the object is keyed by pid and a new pid starts afresh.

Guide: docs/plugins.md, "Which process loads what".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from gateway import envs
from gateway.plugins.records import LoadReport


@dataclass
class PluginProcess:
    #: "api-server", "engine-core", "worker-<rank>", "headless", "cli" or "main".
    role: str
    pid: int = field(default_factory=os.getpid)
    report: LoadReport = field(init=False)
    #: Set before the first general plugin runs (rule 4: once per process).
    general_plugins_loaded: bool = False
    #: The logits-processor classes a sampler here loaded, by the `--logits-processors`
    #: names: the engine core validates requests with these rather than import them again.
    sampler_logits_processors: dict[tuple[str, ...], list[type]] = field(default_factory=dict)
    #: The general plugin being called now (load_general_plugins), so that what it
    #: registers (a LoRA resolver) is recorded under its distribution.
    calling_general_plugin: Any = None
    #: The LoRA resolvers general plugins registered here, by name, in order.
    lora_resolvers: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.report = LoadReport(lambda: self.role)

    def where(self) -> str:
        return f"process {self.role} (pid {self.pid})"


_current: PluginProcess | None = None


def start_process(role: str) -> PluginProcess:
    """Name this process. The first call makes its state; a later one (a Worker built
    inside the engine core, say) renames it and keeps what was recorded so far."""
    state = this_process()
    state.role = role
    return state


def this_process() -> PluginProcess:
    global _current
    if _current is None or _current.pid != os.getpid():
        _current = PluginProcess(envs.process_role() or "main")
    return _current


def process_role() -> str:
    return this_process().role


def load_report() -> LoadReport:
    """This process's load report (what `GET /v1/plugins` shows for it)."""
    return this_process().report


def reset_for_tests() -> None:
    """Forget this process's state (role, report, flag); tests only."""
    global _current
    _current = None
