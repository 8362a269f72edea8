"""The kernels' AVX-512 bfloat16 paths forbidden for a while, for tests that run both ways."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from gateway.models.kernels.cpu.library import load


@contextlib.contextmanager
def wide_bf16_rows(allow: bool) -> Iterator[bool]:
    """The AVX-512 bfloat16 kernels (elementwise rows, decode attention, quantized products
    of bfloat16 rows) allowed or not; yields whether they run. Allowed again after."""
    library = load()
    assert library is not None, "the kernels must build on the test machine (cc, AVX2)"
    try:
        yield bool(library.gw_wide_bf16_rows(int(allow)))
    finally:
        library.gw_wide_bf16_rows(1)
