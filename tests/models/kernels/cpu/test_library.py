"""The kernels' library (library.py): built from every C file beside it, each C function
Python calls declared once, and run on the OpenMP library torch loaded."""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import torch

from gateway.models.kernels.cpu import library

# A function the library exports: defined at the start of a line, not static or INTERNAL.
_EXPORTED = re.compile(r"^(?:KERNEL |KERNEL512 )?(?:int|void|int64_t) (gw_\w+)\(", re.MULTILINE)


def test_every_exported_function_is_declared_once():
    folder = Path(library.__file__).parent
    exported = [name for source in sorted(folder.glob("*.c"))
                for name in _EXPORTED.findall(source.read_text())]
    assert len(exported) == len(set(exported))
    assert set(exported) == set(library.SIGNATURES)
    loaded = library.load()
    assert loaded is not None, "the kernels must build on the test machine (cc, AVX2)"
    for name, (argtypes, restype) in library.SIGNATURES.items():
        function = getattr(loaded, name)
        assert (function.argtypes, function.restype) == (argtypes, restype)


def test_the_float32_kernels_run_on_the_openmp_library_torch_loaded() -> None:
    loaded = library.load()
    assert loaded is not None

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    def provider(handle: ctypes.CDLL, symbol: str) -> str:
        info = DlInfo()
        address = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p)
        assert ctypes.CDLL(None).dladdr(address, ctypes.byref(info))
        return os.path.realpath(info.fname.decode())

    torch_cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                         "libtorch_cpu.so"))
    # one thread pool, which torch.set_num_threads sizes
    assert provider(loaded, "GOMP_parallel") == provider(torch_cpu, "omp_get_max_threads")
