"""The gateway's CPU kernels as one shared library, built and loaded in the worker.

The C files beside this module (one per concern: quant_matmul.c, quant_int8.c,
kquant_int8.c, dequantize.c, attention.c, lone_decode.c, elementwise.c, sampling.c, and
isa.c for the instruction-set level) are compiled with the C compiler (`cc`, or $CC) into
one library in the cache folder (GATEWAY_CACHE_DIR) the first time a worker needs it, and
loaded with ctypes, which lets go of the GIL during a call. `SIGNATURES` declares every C
function Python calls. Where there is no compiler, the CPU lacks AVX2, or
GATEWAY_CPU_QUANT_KERNELS=0, `load()` returns None (with a log line saying why) and each
caller runs torch's ops instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from gateway import envs
from gateway.logger import init_logger
from gateway.platforms.cpu_isa import cpu_isa

logger = init_logger(__name__)

_FOLDER = Path(__file__).parent
# -fopenmp links libgomp by its soname, which resolves to the copy torch has already loaded,
# so the kernels share torch's thread pool and follow torch.set_num_threads.
_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp")
_LIBS = ("-lm",)  # after the sources: the linker keeps only the libraries it uses by then

_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
#: Every C function Python calls: name -> (argument types, result type), by C file.
SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    # isa.c
    "gw_supported": ([], _int),
    "gw_set_isa_level": ([_int], None),
    "gw_wide_bf16_rows": ([_int], _int),
    # quant_matmul.c
    "gw_quant_matmul": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int, _ptr], _int),
    "gw_quant_matmul_bf16": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int, _ptr, _int],
                             _int),
    "gw_bf16_products": ([], _int),
    "gw_kquant_matmul": ([_ptr, _i64, _i64, _ptr, _i64, _ptr], _int),
    # moe_quant.c
    "gw_moe_quant_matmul": ([_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _int],
                            _int),
    # dequantize.c
    "gw_quant_dequantize": ([_ptr, _ptr, _ptr, _i64, _int, _ptr, _i64, _ptr, _int], None),
    "gw_kquant_dequantize": ([_ptr, _i64, _ptr, _i64, _ptr, _int], _int),
    # lone_decode.c
    "gw_lone_scratch_floats": ([_ptr, _i64], _i64),
    "gw_lone_decode": ([_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64,
                        _ptr, _ptr, _ptr, _i64], _int),
    # attention.c
    "gw_decode_attention": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                             _i64, _int, _ptr], _int),
    # elementwise.c
    "gw_add_rms_norm": ([_ptr, _ptr, _ptr, _i64, _i64, _float, _int, _ptr], _int),
    "gw_silu_mul": ([_ptr, _i64, _i64, _int, _ptr], _int),
    "gw_rotary": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _int], _int),
    # sampling.c
    "gw_draw": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr], _int),
    # quant_int8.c
    "gw_int8_paths": ([], _int),
    "gw_quant_matmul_int8": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int, _ptr, _int],
                             _int),
    "gw_quantize_int8": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int], _int),
    # kquant_int8.c
    "gw_kquant_matmul_int8": ([_ptr, _i64, _i64, _ptr, _i64, _ptr, _int], _int),
}


def _sources() -> list[Path]:
    return sorted(_FOLDER.glob("*.c"))


def _build(compiler: str) -> Path:
    """The library built from the C files and headers here, named for their contents and
    the command; built only where that file is not in the cache folder yet."""
    command = " ".join((compiler, *_FLAGS, *_LIBS))
    digest = hashlib.sha256(command.encode())
    for path in sorted((*_sources(), *_FOLDER.glob("*.h"))):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    folder = Path(envs.cache_dir()) / "kernels"
    target = folder / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed: processes building at once never see half a file
    fd, partial = tempfile.mkstemp(dir=folder, suffix=".so.partial")
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, "-o", partial, *map(str, _sources()), *_LIBS],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _declare(library: ctypes.CDLL) -> None:
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype


@functools.cache
def load() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run here (logged once)."""
    if not envs.cpu_quant_kernels():
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        logger.info("Quantized GGUF weights use torch's int4 kernel: the gateway's float32 "
                    "kernels are for x86-64 CPUs")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.info("Quantized GGUF weights use torch's int4 kernel (bfloat16): no C compiler "
                    "(cc, or $CC) to build the gateway's float32 kernels")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("Quantized GGUF weights use torch's int4 kernel: building the "
                       "float32 kernels failed: %s", str(detail).strip()[:500])
        return None
    _declare(library)
    isa = cpu_isa()
    if not (isa.runs_gateway_kernels and library.gw_supported()):
        logger.info("Quantized GGUF weights use torch's int4 kernel: this CPU (%s) lacks "
                    "AVX2, FMA or F16C", isa.describe())
        return None
    library.gw_set_isa_level(int(isa.level))
    return library
