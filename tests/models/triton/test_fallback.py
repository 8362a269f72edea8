"""A Triton kernel that cannot be compiled for the device gives way to its torch
reference: one WARNING naming it, the reference for every later call; other errors are
not hidden."""

from __future__ import annotations

import logging

import pytest
from triton.runtime.errors import OutOfResources

from gateway.models.kernels.triton.fallback import KernelWithFallback


def test_a_kernel_that_cannot_compile_falls_back_once_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []

    def kernel(x: int) -> int:
        calls.append("kernel")
        raise OutOfResources(232448, 101376, "shared memory")

    def reference(x: int) -> int:
        calls.append("reference")
        return x + 1

    guarded = KernelWithFallback("paged_attention", kernel, reference)
    with caplog.at_level(logging.WARNING, logger="gateway"):
        assert [guarded(1), guarded(2), guarded(3)] == [2, 3, 4]
    assert calls == ["kernel", "reference", "reference", "reference"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "paged_attention" in warnings[0].getMessage()
    assert "OutOfResources" in warnings[0].getMessage()


def test_a_kernel_that_compiles_is_used() -> None:
    guarded = KernelWithFallback("store_kv", lambda x: x * 2, lambda x: -1)
    assert guarded(4) == 8
    assert not guarded.failed


def test_errors_other_than_compiling_are_raised() -> None:
    def kernel() -> None:
        raise ValueError("bad shape")

    guarded = KernelWithFallback("store_kv", kernel, lambda: None)
    with pytest.raises(ValueError, match="bad shape"):
        guarded()
    assert not guarded.failed
