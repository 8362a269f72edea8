"""The trial compile, in the engine core's grammar helper processes (gateway.helper_process).

xgrammar cannot be interrupted: a grammar that takes minutes holds its thread (and its
memory) for minutes. So each new grammar is first compiled here, in a helper the engine
core kills when it passes the time limit or whose address space is capped, and only a
grammar that compiled here within the limits is compiled again in the engine core. A
compiled grammar is not sent back: xgrammar serializes one several times slower than it
compiles it (docs/structured-outputs.md has the figures).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def start_helper(tokenizer_info_json: str) -> Callable[[list[Any]], list[float]]:
    """The job function of a helper: [kind, spec, disable_any_whitespace] -> [compiled
    size in bytes, seconds]; GrammarSpecError (by name) when the spec does not compile."""
    import xgrammar as xgr

    from gateway.engine.structured_output.xgrammar_backend import XgrammarBackend

    backend = XgrammarBackend(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json))

    def trial(job: list[Any]) -> list[float]:
        kind, spec, disable_any_whitespace = job
        started = time.monotonic()
        compiled = backend.compile(kind, spec, bool(disable_any_whitespace))
        return [float(compiled.memory_size_bytes), time.monotonic() - started]

    return trial
