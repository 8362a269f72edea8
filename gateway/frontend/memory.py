"""Large freed buffers handed back to the OS (API-server process).

glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), so after a
few multi-megabyte request bodies their buffers come from the heap and stay resident: the
front end kept tens of MiB after bodies it had refused. A fixed threshold keeps every block
above it in a mapping of its own, unmapped when freed; the front end makes few of them.
The millions of small objects of such a body are freed inside the heaps of the threads
that parsed them: `trim_heaps` hands their free pages back after each large body.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at its initial value, which stops its growth; False where
    the C library has no such setting, or the operator set MALLOC_MMAP_THRESHOLD_ (then
    glibc has fixed it at that value already)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def trim_heaps() -> bool:
    """glibc's `malloc_trim(0)`: the free pages of every heap (each thread's too) go back
    to the OS. False where the C library has no such call or nothing was released."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(malloc_trim(0))
