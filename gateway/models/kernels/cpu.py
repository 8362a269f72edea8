"""The gateway's own CPU kernels for quantized GGUF weights (Q4_0, Q4_1, Q8_0), in float32,
and for the attention of many decodes read in place from the paged KV cache.

torch's int4 kernel computes in bfloat16 on CPUs without AVX-512 (and re-reads the weight
for every 4 rows); these compute in float32 from the codes, scales and minimums as the file
holds them, so a quantized model answers as its dequantized float32 weights do, and a
batch-1 step reads 4 to 8 times fewer bytes than the dequantized model. Rows of bfloat16
activations (4 to 256 a product) run, on CPUs with AVX512-BF16, a kernel that multiplies
them with the codes themselves in bfloat16 (exact: the codes are small integers) and sums
in float32, at twice the float32 kernel's multiply-adds an instruction: a 32-row step's
products took 0.33-0.43x the float32 kernel's time on a 2-core AMD EPYC
(bench/bench_quant_kernels.py).

The C sources in the folder beside this file (`cpu/`, one file per concern; AVX2 + FMA +
F16C, and AVX-512 where the CPU has it) are compiled with the C compiler (`cc`, or $CC) into
one library the first time a worker needs it, in the cache folder (GATEWAY_CACHE_DIR), and
loaded with ctypes, which lets go of the GIL during a call. Where
there is no compiler, the CPU lacks AVX2, or GATEWAY_CPU_QUANT_KERNELS=0, `load()` returns
None (with a log line saying why) and the caller uses torch's kernel.

`decode_attention` serves two or more decodes in one step (float32 or bfloat16): each
(sequence, kv head) reads its blocks where they lie, with a running softmax, so the blocks
are not gathered into a copy first and no mask is built; against the gather and two
batched matmuls it runs 2-3x faster at 32 sequences of 256 tokens.
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

import torch
import torch.nn.functional as F

from gateway import envs
from gateway.logger import init_logger
from gateway.models.layers.cpu_linear import can_pack, onednn_linear
from gateway.models.layers.gguf_quant import GROUP_SIZE, QuantWeight
from gateway.platforms.cpu_isa import cpu_isa

logger = init_logger(__name__)

_FOLDER = Path(__file__).with_suffix("")  # cpu/: the C files and their headers
# -fopenmp links libgomp by its soname, which resolves to the copy torch has already loaded,
# so the kernels share torch's thread pool and follow torch.set_num_threads.
_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp")
_LIBS = ("-lm",)  # after the sources: the linker keeps only the libraries it uses by then
# More rows a call (a long prefill): dequantize the weight and run a dense matmul, which
# is faster from about 64-128 rows on (there sgemm's blocking beats the kernel's tiles).
MAX_KERNEL_ROWS = 64
# bfloat16 rows, MIN_ to MAX_BF16_KERNEL_ROWS of them, run the AVX512-BF16 kernel where the
# CPU has it (gw_quant_matmul_bf16 in cpu/quant_matmul.c): on a 2-core AMD EPYC a step's products
# took 0.33-0.5x the float32 kernel's time from 8 rows on and matched a dequantized product
# at 256. Fewer rows read the weights at memory speed in the float32 kernel, which does not
# lay the codes out anew; more are dequantized, as above.
MIN_BF16_KERNEL_ROWS, MAX_BF16_KERNEL_ROWS = 4, 256


def _sources() -> list[Path]:
    return sorted(_FOLDER.glob("*.c"))


def _build(compiler: str) -> Path:
    """The library built from the C files and headers in cpu/, named for their contents
    and the command; built only where that file is not in the cache folder yet."""
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
    isa = cpu_isa()
    if not (isa.runs_gateway_kernels and library.gw_supported()):
        logger.info("Quantized GGUF weights use torch's int4 kernel: this CPU (%s) lacks "
                    "AVX2, FMA or F16C", isa.describe())
        return None
    library.gw_set_isa_level.argtypes = [ctypes.c_int]
    library.gw_set_isa_level.restype = None
    library.gw_set_isa_level(int(isa.level))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.gw_quant_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int, ptr]
    library.gw_quant_matmul.restype = ctypes.c_int
    library.gw_quant_matmul_bf16.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int,
                                             ptr, ctypes.c_int]
    library.gw_quant_matmul_bf16.restype = ctypes.c_int
    library.gw_quant_dequantize.argtypes = [ptr, ptr, ptr, i64, ctypes.c_int, ptr, i64, ptr,
                                            ctypes.c_int]
    library.gw_quant_dequantize.restype = None
    library.gw_lone_scratch_floats.argtypes = [ptr]
    library.gw_lone_scratch_floats.restype = i64
    library.gw_lone_decode.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr,
                                       ptr, ptr, i64]
    library.gw_lone_decode.restype = ctypes.c_int
    library.gw_decode_attention.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                            i64, ctypes.c_int, ptr]
    library.gw_decode_attention.restype = ctypes.c_int
    library.gw_add_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int,
                                        ptr]
    library.gw_add_rms_norm.restype = ctypes.c_int
    library.gw_silu_mul.argtypes = [ptr, i64, i64, ctypes.c_int, ptr]
    library.gw_silu_mul.restype = ctypes.c_int
    library.gw_rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_int]
    library.gw_rotary.restype = ctypes.c_int
    library.gw_wide_bf16_rows.argtypes = [ctypes.c_int]
    library.gw_wide_bf16_rows.restype = ctypes.c_int
    library.gw_bf16_products.argtypes = []
    library.gw_bf16_products.restype = ctypes.c_int
    library.gw_draw.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr]
    library.gw_draw.restype = ctypes.c_int
    return library


def has_bf16_products() -> bool:
    """Whether the kernels run products of bfloat16 rows with quantized weights here
    (AVX512-BF16; `Float32QuantWeight.matmul` of MIN_ to MAX_BF16_KERNEL_ROWS rows)."""
    library = load()
    return library is not None and bool(library.gw_bf16_products())


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     lens: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """One query per sequence, q [B, H, D], attending to its `lens` [B] tokens in the paged
    `kv_cache` [2, KV, num_slots, D] through its `block_table` [B, blocks] (both int32),
    read in place: [B, H, D], or None where the kernels cannot take it (then the caller
    gathers the blocks and runs torch's ops)."""
    library = load()
    if (library is None or q.dtype not in (torch.float32, torch.bfloat16)
            or kv_cache.dtype != q.dtype or q.device.type != "cpu"
            or not kv_cache.is_contiguous()):
        return None
    batch, heads, dim = q.shape
    if block_table.dtype != torch.int32 or lens.dtype != torch.int32 \
            or block_table.shape[0] != batch or lens.shape != (batch,):
        raise ValueError("block_table [B, blocks] and lens [B] must be int32")
    q = q.contiguous()
    block_table, lens = block_table.contiguous(), lens.contiguous()
    out = torch.empty_like(q)
    status = library.gw_decode_attention(
        q.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(), lens.data_ptr(), batch,
        heads, kv_cache.shape[1], dim, block_size, kv_cache.shape[2], block_table.shape[1],
        int(q.dtype == torch.bfloat16), out.data_ptr())
    return out if status == 0 else None


def draw(logits: torch.Tensor, thresholds: torch.Tensor | None,
         uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """sampling_ops.draw in one call: logits [n, vocab] float32 (not modified),
    thresholds [n, 1] or None, uniforms [n] -> tokens [n] int64 and ok [n] bool; None
    where the kernels cannot take them (the caller runs torch's ops)."""
    library = load()
    if (library is None or logits.device.type != "cpu" or logits.dtype != torch.float32
            or logits.dim() != 2 or not logits.is_contiguous() or logits.shape[1] == 0):
        return None
    rows = logits.shape[0]
    limits = (None if thresholds is None
              else thresholds.reshape(rows).to(torch.float32).contiguous())
    draws = uniforms.reshape(rows).to(torch.float32).contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    ok = torch.empty(rows, dtype=torch.bool)
    status = library.gw_draw(logits.data_ptr(), rows, logits.shape[1],
                             None if limits is None else limits.data_ptr(), draws.data_ptr(),
                             tokens.data_ptr(), ok.data_ptr())
    if status != 0:
        raise MemoryError("the sampling kernel could not allocate its buffer")
    return tokens, ok


_scratch_buffers: dict[torch.dtype, torch.Tensor] = {}


def _scratch(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A `shape` tensor of `dtype` in one buffer a dtype, reused by every weight's dense
    matmul: the weights of a step are dequantized one after another, and a fresh tensor
    each time cost a page fault for every 4 KiB of it."""
    size = shape[0] * shape[1]
    buffer = _scratch_buffers.get(dtype)
    if buffer is None or buffer.numel() < size:
        _scratch_buffers[dtype] = buffer = torch.empty(size, dtype=dtype)
    return buffer[:size].view(shape)


def _written_dtype(dtype: torch.dtype) -> torch.dtype:
    """What gw_quant_dequantize writes for a weight wanted in `dtype`: bfloat16 directly,
    anything else as float32 (converted after)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


class Float32QuantWeight:
    """A quantized [N, K] weight in the kernels' layout: codes [N, K / 32, 16 or 32] uint8,
    scales and minimums [N, K / 32] float16 (what the GGUF file holds)."""

    def __init__(self, weight: QuantWeight, library: ctypes.CDLL) -> None:
        rows, cols = weight.shape
        if cols % GROUP_SIZE:
            raise ValueError(f"{cols} input columns are not whole groups of {GROUP_SIZE}")
        self.scales = weight.scale.to(torch.float16).contiguous()
        self.minimums = weight.minimum.to(torch.float16).contiguous()
        if not (torch.equal(self.scales.float(), weight.scale)
                and torch.equal(self.minimums.float(), weight.minimum)):
            raise ValueError("its scales or minimums are not half floats")
        grouped = weight.codes.view(rows, cols // GROUP_SIZE, GROUP_SIZE)
        if weight.bits == 4:  # GGUF's order: byte j holds columns j and j + 16 of a group
            grouped = grouped[..., :16] | (grouped[..., 16:] << 4)
        self.codes = grouped.contiguous()
        self.bits, self.shape, self.is_readable = weight.bits, (rows, cols), True
        self._library = library

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x W^T [M, N] in x's dtype."""
        if x.dim() != 2 or x.shape[1] != self.shape[1] or x.device.type != "cpu":
            raise ValueError(f"expected a CPU [M, {self.shape[1]}] input, got "
                             f"{list(x.shape)} on {x.device}")  # the C code trusts the shape
        num_rows = x.shape[0]
        if (x.dtype == torch.bfloat16 and self.shape[0] % 16 == 0
                and MIN_BF16_KERNEL_ROWS <= num_rows <= MAX_BF16_KERNEL_ROWS):
            y16 = self._matmul_bf16(x)
            if y16 is not None:
                return y16
        if num_rows > MAX_KERNEL_ROWS:
            weight = self.dequantize(x.dtype, out=_scratch(self.shape, _written_dtype(x.dtype)))
            if can_pack(x.device, x.dtype):
                return onednn_linear(x, weight)
            return F.linear(x, weight)
        x32 = x.to(torch.float32).contiguous()
        y = torch.empty(num_rows, self.shape[0], dtype=torch.float32)
        status = self._library.gw_quant_matmul(
            x32.data_ptr(), num_rows, self.shape[1], self.codes.data_ptr(),
            self.scales.data_ptr(), self.minimums.data_ptr(), self.shape[0], self.bits,
            y.data_ptr())
        if status != 0:
            raise MemoryError("the quantized matmul kernel could not allocate its buffer")
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _matmul_bf16(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] bfloat16 -> x W^T [M, N] bfloat16 through the AVX512_BF16 kernel (N a
        multiple of 16), or None where this CPU lacks it."""
        x16 = x.contiguous()
        y = torch.empty(x.shape[0], self.shape[0], dtype=torch.bfloat16)
        status = self._library.gw_quant_matmul_bf16(
            x16.data_ptr(), x.shape[0], self.shape[1], self.codes.data_ptr(),
            self.scales.data_ptr(), self.minimums.data_ptr(), self.shape[0], self.bits,
            y.data_ptr(), 1)
        if status == -1:
            raise MemoryError("the quantized matmul kernel could not allocate its buffer")
        return y if status == 0 else None

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [N, K] (or its `rows` [R, K]) in `dtype`: computed in float32, and
        written as bfloat16 directly where `dtype` is bfloat16; into `out` (contiguous, of
        that shape, float32 or bfloat16) where given."""
        index = None if rows is None else rows.to(torch.int64).contiguous()
        if index is not None and index.numel() and (
                int(index.min()) < 0 or int(index.max()) >= self.shape[0]):
            raise IndexError(f"rows outside the weight's {self.shape[0]}")
        count = self.shape[0] if index is None else index.numel()
        if out is None:
            out = torch.empty(count, self.shape[1], dtype=_written_dtype(dtype))
        if out.shape != (count, self.shape[1]) or not out.is_contiguous() \
                or out.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"out must be a contiguous float32 or bfloat16 "
                             f"[{count}, {self.shape[1]}]")
        self._library.gw_quant_dequantize(
            self.codes.data_ptr(), self.scales.data_ptr(), self.minimums.data_ptr(),
            self.shape[1], self.bits, None if index is None else index.data_ptr(), count,
            out.data_ptr(), int(out.dtype == torch.bfloat16))
        return out if out.dtype == dtype else out.to(dtype)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.minimums))


# ---------------------------------------------------------------- elementwise steps
# float32 and bfloat16 rows only; anything else (or no library, or another device) gets
# None and the caller runs torch's ops.
_ROW_DTYPES = (torch.float32, torch.bfloat16)


def _rows_library(x: torch.Tensor) -> ctypes.CDLL | None:
    if x.device.type != "cpu" or x.dtype not in _ROW_DTYPES:
        return None
    return load()


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """x [R, E], the residual stream: adds `delta` into it in place (if given), then
    returns its RMS norm times `weight`, in one pass; None where the kernels do not take
    these tensors (nothing is changed then)."""
    library = _rows_library(x)
    if (library is None or x.dim() != 2 or not x.is_contiguous() or weight.dtype != x.dtype
            or not weight.is_contiguous() or weight.shape != x.shape[1:]
            or (delta is not None and (delta.dtype != x.dtype or delta.shape != x.shape
                                       or not delta.is_contiguous()))):
        return None
    out = torch.empty_like(x)
    status = library.gw_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                                     weight.data_ptr(), x.shape[0], x.shape[1], eps,
                                     int(x.dtype == torch.bfloat16), out.data_ptr())
    return out if status == 0 else None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [R, 2 I] -> silu(gate) * up [R, I] in one pass; None where the kernels do
    not take it."""
    library = _rows_library(gate_up)
    if library is None or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inter))
    status = library.gw_silu_mul(gate_up.data_ptr(), rows, inter,
                                 int(gate_up.dtype == torch.bfloat16), out.data_ptr())
    return out if status == 0 else None


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [N, heads, D] (its heads contiguous within a row, rows at any stride) rotated in
    place by cos, sin [N, 1, D]; False (x untouched) where the kernels do not take them."""
    library = _rows_library(x)
    if (library is None or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]
            or cos.dtype != x.dtype or sin.dtype != x.dtype
            or cos.shape != (x.shape[0], 1, x.shape[2]) or sin.shape != cos.shape
            or not cos.is_contiguous() or not sin.is_contiguous()):
        return False
    return library.gw_rotary(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2],
                             cos.data_ptr(), sin.data_ptr(),
                             int(x.dtype == torch.bfloat16)) == 0
