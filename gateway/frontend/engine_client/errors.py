"""The engine client's errors (front-end process): the engine is gone, or never started."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served."""


class EngineStartError(RuntimeError):
    """The engine core could not start (its message says why)."""
