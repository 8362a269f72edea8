"""gateway: a plugin-extensible, OpenAI-compatible LLM serving gateway.

Its folders say which process runs their code: frontend/ the API servers, engine/ the
engine core, executor/ and worker/ the workers, plugins/ and platforms/ every process.
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # `gateway.LLM` without importing the engine (and torch) on `import gateway`.
    if name == "LLM":
        from gateway.frontend.llm import LLM
        return LLM
    raise AttributeError(f"module 'gateway' has no attribute {name!r}")
