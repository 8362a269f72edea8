"""A Triton kernel beside its torch reference (worker process): where the kernel cannot be
compiled for the device (an unsupported dtype or instruction, too little shared memory),
one WARNING names it and the reference serves every later call, so the worker keeps
answering, slower, instead of failing each step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

from gateway.logger import init_logger

logger = init_logger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def compile_errors() -> tuple[type[BaseException], ...]:
    """What Triton raises when it cannot build a kernel for the device: its compiler's
    errors, ptxas's, and a launch needing more resources than the device has."""
    from triton.errors import TritonError

    return (TritonError,)


class KernelWithFallback(Generic[P, R]):
    """Calls `kernel` until it fails to compile, then `reference` (same signature)."""

    def __init__(self, name: str, kernel: Callable[P, R], reference: Callable[P, R],
                 errors: tuple[type[BaseException], ...] | None = None) -> None:
        self.name, self.kernel, self.reference = name, kernel, reference
        self.errors = compile_errors() if errors is None else errors
        self.failed = False

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if not self.failed:
            try:
                return self.kernel(*args, **kwargs)
            except self.errors as error:
                self.failed = True
                logger.warning("Triton kernel %s cannot be compiled for this device (%s: "
                               "%s); its torch reference runs instead", self.name,
                               type(error).__name__, str(error).splitlines()[0][:200]
                               if str(error) else "")
        return self.reference(*args, **kwargs)
