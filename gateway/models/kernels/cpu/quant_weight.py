"""Quantized GGUF weights kept in the gateway's CPU kernels: Q4_0, Q4_1 and Q8_0 in the
kernels' layout (`Float32QuantWeight`), the K-quants, Q5_0 and Q5_1 in their file's blocks
(`BlockQuantWeight`); multiplied (quant_matmul.c) and dequantized (dequantize.c) there.

torch's int4 kernel computes in bfloat16 on CPUs without AVX-512 (and re-reads the weight
for every 4 rows); these compute in float32 from the codes, scales and minimums as the
file holds them, so a quantized model answers as its dequantized float32 weights do, and
a batch-1 step reads 4 to 8 times fewer bytes. On CPUs with AVX512-BF16, bfloat16 rows
(MIN_ to MAX_BF16_KERNEL_ROWS a product) are multiplied with the codes themselves in
bfloat16 (exact: the codes are small integers), summed in float32 (docs/cpu-performance.md).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from gateway.models.kernels.cpu import quant_int8
from gateway.models.kernels.cpu.library import load
from gateway.models.layers.cpu_linear import can_pack, onednn_linear
from gateway.models.layers.gguf_quant import (
    GROUP_SIZE,
    MAX_BLOCK_PARTS,
    BlockWeight,
    QuantWeight,
)

# More rows a call (a long prefill): dequantize the weight and run a dense matmul, which
# is faster from about 64-128 rows on (there sgemm's blocking beats the kernel's tiles).
MAX_KERNEL_ROWS = 64
# bfloat16 rows, MIN_ to MAX_BF16_KERNEL_ROWS of them, run the AVX512-BF16 kernel where the
# CPU has it (gw_quant_matmul_bf16): from a few rows on it takes a fraction of the float32
# kernel's time, and at the upper limit it matches a dequantized product. Fewer rows read
# the weights at memory speed in the float32 kernel, which does not lay the codes out anew;
# more are dequantized, as above.
MIN_BF16_KERNEL_ROWS, MAX_BF16_KERNEL_ROWS = 4, 256
# Weights in their file's blocks (BlockQuantWeight) take more rows than these to a dense
# matmul of the weight dequantized: float32 rows from 17 on, bfloat16 ones where oneDNN
# multiplies bfloat16 (AMX, AVX512-BF16) from 9 on; below, the block kernels' tiles win
# (measured with one thread on a 2-core Xeon: at 32 rows the tiles took 1.4x the dense
# float32 product's time and 2.4x the bfloat16 one's; at 8 rows 0.8x).
MAX_BLOCK_KERNEL_ROWS, MAX_BLOCK_KERNEL_ROWS_BF16 = 16, 8
# The block types whose products take 8-bit activations (GATEWAY_CPU_INT8_ACTIVATIONS=1).
K_QUANTS_WITH_INT8 = frozenset({"Q4_K", "Q5_K", "Q6_K"})


def has_bf16_products() -> bool:
    """Whether the kernels run products of bfloat16 rows with quantized weights here
    (AVX512-BF16; `Float32QuantWeight.matmul` of MIN_ to MAX_BF16_KERNEL_ROWS rows)."""
    library = load()
    return library is not None and bool(library.gw_bf16_products())


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


def _dense_product(weight: Float32QuantWeight | BlockQuantWeight,
                   x: torch.Tensor) -> torch.Tensor:
    """x W^T for many rows: the weight dequantized into the shared scratch, then a dense
    matmul."""
    dense = weight.dequantize(x.dtype, out=_scratch(weight.shape, _written_dtype(x.dtype)))
    if can_pack(x.device, x.dtype):
        return onednn_linear(x, dense)
    return F.linear(x, dense)


def _checked_out(shape: tuple[int, int], dtype: torch.dtype, rows: torch.Tensor | None,
                 out: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The row index (int64, checked against the weight's rows) and the output buffer of a
    dequantize call."""
    index = None if rows is None else rows.to(torch.int64).contiguous()
    if index is not None and index.numel() and (
            int(index.min()) < 0 or int(index.max()) >= shape[0]):
        raise IndexError(f"rows outside the weight's {shape[0]}")
    count = shape[0] if index is None else index.numel()
    if out is None:
        out = torch.empty(count, shape[1], dtype=_written_dtype(dtype))
    if out.shape != (count, shape[1]) or not out.is_contiguous() \
            or out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out must be a contiguous float32 or bfloat16 [{count}, {shape[1]}]")
    return index, out


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
        # 8-bit activations' path where turned on (quant_int8.py; logged once a process)
        self._int8_path = quant_int8.int8_path()

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
        if (self._int8_path is not None
                and quant_int8.MIN_INT8_ROWS <= num_rows <= quant_int8.MAX_INT8_ROWS):
            y = quant_int8.matmul(x.to(torch.float32).contiguous(), self.codes, self.scales,
                                  self.minimums, self.shape, self.bits, self._int8_path)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if num_rows > MAX_KERNEL_ROWS:
            return _dense_product(self, x)
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
        index, out = _checked_out(self.shape, dtype, rows, out)
        count = out.shape[0]
        self._library.gw_quant_dequantize(
            self.codes.data_ptr(), self.scales.data_ptr(), self.minimums.data_ptr(),
            self.shape[1], self.bits, None if index is None else index.data_ptr(), count,
            out.data_ptr(), int(out.dtype == torch.bfloat16))
        return out if out.dtype == dtype else out.to(dtype)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.minimums))


class _Part(ctypes.Structure):  # kquant.h's gw_kq_part
    _fields_ = [("blocks", ctypes.c_void_p), ("type", ctypes.c_int64), ("rows", ctypes.c_int64)]


class _Parts(ctypes.Structure):  # kquant.h's gw_kq_parts
    _fields_ = [("num_parts", ctypes.c_int64), ("parts", _Part * MAX_BLOCK_PARTS)]


class BlockQuantWeight:
    """A [N, K] weight in its GGUF file's blocks (K-quants, Q5_0, Q5_1; kquant.h), one or
    more parts of whole rows, multiplied in float32 from the blocks as they are."""

    def __init__(self, weight: BlockWeight, library: ctypes.CDLL) -> None:
        if len(weight.parts) > MAX_BLOCK_PARTS:
            raise ValueError(f"{len(weight.parts)} parts of different block types (the "
                             f"kernels take {MAX_BLOCK_PARTS})")
        self.blocks = [part.blocks.contiguous() for part in weight.parts]
        self.types = tuple(part.qtype.name for part in weight.parts)
        #: The C record of the parts (kquant.h's gw_kq_parts), and its address.
        self.record = _Parts(len(self.blocks))
        for slot, part, blocks in zip(self.record.parts, weight.parts, self.blocks, strict=False):
            slot.blocks, slot.type, slot.rows = blocks.data_ptr(), int(part.qtype), blocks.shape[0]
        self.address = ctypes.addressof(self.record)
        self.shape, self.is_readable = weight.shape, True
        self._library = library
        # 8-bit activations' path where turned on and every part is a K-quant (kquant_int8.c;
        # Q5_0, Q5_1 and Q8_0 parts keep the float32 products)
        self._int8_path = (quant_int8.int8_path()
                           if set(self.types) <= K_QUANTS_WITH_INT8 else None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x W^T [M, N] in x's dtype."""
        if x.dim() != 2 or x.shape[1] != self.shape[1] or x.device.type != "cpu":
            raise ValueError(f"expected a CPU [M, {self.shape[1]}] input, got "
                             f"{list(x.shape)} on {x.device}")  # the C code trusts the shape
        num_rows = x.shape[0]
        if (self._int8_path is not None
                and quant_int8.MIN_INT8_ROWS <= num_rows <= quant_int8.MAX_INT8_ROWS):
            y = quant_int8.kquant_matmul(x.to(torch.float32).contiguous(), self.address,
                                         self.shape, self._int8_path)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        dense_bf16 = x.dtype == torch.bfloat16 and can_pack(x.device, x.dtype)
        if num_rows > (MAX_BLOCK_KERNEL_ROWS_BF16 if dense_bf16 else MAX_BLOCK_KERNEL_ROWS):
            return _dense_product(self, x)
        x32 = x.to(torch.float32).contiguous()
        y = torch.empty(num_rows, self.shape[0], dtype=torch.float32)
        status = self._library.gw_kquant_matmul(x32.data_ptr(), num_rows, self.shape[1],
                                                self.address, self.shape[0], y.data_ptr())
        if status != 0:
            raise MemoryError("the quantized matmul kernel could not allocate its buffer")
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [N, K] (or its `rows` [R, K]) in `dtype`, as Float32QuantWeight's."""
        index, out = _checked_out(self.shape, dtype, rows, out)
        status = self._library.gw_kquant_dequantize(
            self.address, self.shape[1], None if index is None else index.data_ptr(),
            out.shape[0], out.data_ptr(), int(out.dtype == torch.bfloat16))
        if status != 0:
            raise MemoryError("the dequantize kernel could not allocate its buffer")
        return out if out.dtype == dtype else out.to(dtype)

    def num_bytes(self) -> int:
        return sum(blocks.numel() for blocks in self.blocks)
