"""Linear and embedding layers over weights kept 4- or 8-bit (GGUF Q4_0, Q4_1, Q8_0), in the
worker's models, run with torch's CPU kernel for packed int4 weights (`Int4Weight`) or the
gateway's own (kernels/cpu/quant_weight.py).

torch's kernel is vectorized for bfloat16 only, so it runs with bfloat16 activations,
scales and zeros whatever the model dtype, and its output is cast back. It re-reads the
weight for each block of 4 rows, so a step of many tokens (a prefill) dequantizes the
weight to the model dtype for that one matmul instead; that needs the int4 layout, which
differs by CPU and is found once by packing a probe (`_layout`; where it is not
recognised, the kernel runs every batch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gateway.models.layers.gguf_quant import GROUP_SIZE, QuantWeight
from gateway.models.layers.parallel import SINGLE_RANK, TensorParallel, VocabShard

_KERNEL_DTYPE = torch.bfloat16
_MAX_KERNEL_ROWS = 8  # more rows per step: dequantize and run a dense matmul instead
_OUT_MULTIPLE = 16  # the kernel's smallest block of output rows


def can_run() -> bool:
    """Whether this torch has the CPU int4 kernels."""
    return all(hasattr(torch.ops.aten, op) for op in
               ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"))


class QuantMatrix(Protocol):
    """A quantized [N, K] weight as a kernel holds it (Int4Weight here; the gateway's own
    float32 kernels' Float32QuantWeight)."""

    shape: tuple[int, int]
    is_readable: bool  # dequantize() works

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...

    def dequantize(self, dtype: torch.dtype,
                   rows: torch.Tensor | None = None) -> torch.Tensor: ...

    def num_bytes(self) -> int: ...


@dataclass(frozen=True)
class _Int4Matrix:
    packed: torch.Tensor  # [N, K / 2] uint8 in the kernel's layout
    scales_and_zeros: torch.Tensor  # [K / 32, N, 2] bfloat16


class Int4Weight:
    """A quantized [N, K] weight as one or two int4 matrices whose products add up.

    The kernel reads w = (c - 8) * s + z per group of 32 input columns, c a 4-bit code, s and
    z one scale and one zero per group and output row (checked numerically in the tests). So
    a 4-bit weight (code * scale + minimum) is one int4 matrix with s = scale, z = minimum + 8
    scale; an 8-bit weight, code = 16 h + l, is the sum of two: h with s = 16 scale, z =
    minimum + 128 scale, and l with s = scale, z = 8 scale. Exact, and 8 bits a weight:
    `_weight_int8pack_mm` would need one scale per output row, which Q8_0's per-32 scales
    cannot be turned into without re-quantizing.
    """

    def __init__(self, weight: QuantWeight) -> None:
        rows, cols = weight.shape
        if rows % _OUT_MULTIPLE or cols % GROUP_SIZE:
            raise ValueError(f"a [{rows}, {cols}] weight does not fit the int4 kernel "
                             f"(rows a multiple of {_OUT_MULTIPLE}, columns of {GROUP_SIZE})")
        scale, minimum = weight.scale, weight.minimum
        if weight.bits == 4:
            parts = [(weight.codes, scale, minimum + 8 * scale)]
        else:
            parts = [(weight.codes >> 4, 16 * scale, minimum + 128 * scale),
                     (weight.codes & 0x0F, scale, 8 * scale)]
        self.shape = (rows, cols)
        self.is_readable = _layout_for(rows) is not None  # dequantize() works
        self.matrices = [_pack(codes, s, z) for codes, s, z in parts]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x W^T [M, N] in x's dtype."""
        if x.shape[0] > _MAX_KERNEL_ROWS and self.is_readable:
            return F.linear(x, self.dequantize(x.dtype))
        x16 = x.to(_KERNEL_DTYPE).contiguous()
        out = None
        for m in self.matrices:
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(x16, m.packed, GROUP_SIZE,
                                                              m.scales_and_zeros)
            out = part if out is None else out.add_(part)
        assert out is not None
        return out.to(x.dtype)

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [N, K] (or its `rows` [R, K]) in `dtype`; needs a known layout."""
        out = None
        for m in self.matrices:
            values = _dequantize(m, self.shape, rows)
            out = values if out is None else out.add_(values)
        assert out is not None
        return out.to(dtype)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.matrices
                   for t in (m.packed, m.scales_and_zeros))


def _pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> _Int4Matrix:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    scales_and_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(_KERNEL_DTYPE)
    return _Int4Matrix(packed, scales_and_zeros.contiguous())


def _dequantize(m: _Int4Matrix, shape: tuple[int, int], rows: torch.Tensor | None) -> torch.Tensor:
    """[N or R, K] float32 of one int4 matrix, as the kernel computes it."""
    num_rows, cols = shape
    layout = _layout_for(num_rows)
    assert layout is not None
    sz = m.scales_and_zeros.float()  # [G, N, 2]
    if rows is None:
        codes = layout.unpack(m.packed, num_rows, cols)
        scale, zero = sz[..., 0].t(), sz[..., 1].t()  # [N, G]
    else:
        codes = layout.unpack_rows(m.packed, num_rows, cols, rows)
        scale, zero = sz[:, rows, 0].t(), sz[:, rows, 1].t()
    grouped = codes.view(codes.shape[0], -1, GROUP_SIZE).float() - 8
    return (grouped * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(codes.shape[0], cols)


@dataclass(frozen=True)
class _Layout:
    """The kernel's int4 layout: blocks of `block` output rows; byte j of a block's column
    holds row j in its low nibble and row j + block / 2 in its high one (`split`), or rows
    2j and 2j + 1 (not `split`). Rows past the last whole block form one block of their
    own, in pairs (what torch packs on AVX-512 CPUs, whose block is 64 rows; probed for
    each size of that part, `_layout_for`)."""

    block: int
    split: bool

    def unpack(self, packed: torch.Tensor, num_rows: int, cols: int) -> torch.Tensor:
        """[N, K] uint8 codes."""
        whole = num_rows - num_rows % self.block
        view = packed[:whole].reshape(whole // self.block, cols, self.block // 2)
        low, high = view & 0x0F, view >> 4
        pairs = torch.cat((low, high), -1) if self.split else torch.stack((low, high), -1)
        codes = pairs.reshape(whole // self.block, cols, self.block).transpose(1, 2) \
            .reshape(whole, cols)
        if whole == num_rows:
            return codes
        tail = packed[whole:].reshape(cols, (num_rows - whole) // 2)
        tail_codes = torch.stack((tail & 0x0F, tail >> 4), -1).reshape(cols, -1).t()
        return torch.cat((codes, tail_codes))

    def unpack_rows(self, packed: torch.Tensor, num_rows: int, cols: int,
                    rows: torch.Tensor) -> torch.Tensor:
        """[R, K] uint8 codes of `rows` [R] (an embedding lookup)."""
        whole = num_rows - num_rows % self.block
        view = packed[:whole].reshape(whole // self.block, cols, self.block // 2)
        in_tail = rows >= whole
        mine = torch.where(in_tail, 0, rows)
        within = mine % self.block
        half = self.block // 2
        if self.split:
            byte, is_high = within % half, within >= half
        else:
            byte, is_high = within // 2, within % 2 == 1
        values = view[mine // self.block, :, byte] if whole else \
            torch.zeros(len(rows), cols, dtype=torch.uint8)  # [R, K]
        if whole < num_rows:
            tail = packed[whole:].reshape(cols, (num_rows - whole) // 2)
            local = torch.where(in_tail, rows - whole, 0)
            values = torch.where(in_tail.unsqueeze(1), tail[:, local // 2].t(), values)
            is_high = torch.where(in_tail, local % 2 == 1, is_high)
        return torch.where(is_high.unsqueeze(1), values >> 4, values & 0x0F)


def _probe(num_rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(num_rows)
    probe = torch.randint(0, 16, (num_rows, cols), generator=generator, dtype=torch.int32)
    return probe, torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)


@functools.cache
def _layout() -> _Layout | None:
    """The layout this CPU's kernel packs into, found by packing a probe (None: unknown)."""
    if not can_run():
        return None
    probe, packed = _probe(128, 64)
    for block in (64, 32, 16):
        for split in (True, False):
            layout = _Layout(block, split)
            if torch.equal(layout.unpack(packed, 128, 64).to(torch.int32), probe):
                return layout
    return None


@functools.cache
def _layout_for(num_rows: int) -> _Layout | None:
    """The layout, where a weight of `num_rows` rows is read as it says: all whole blocks,
    or whole blocks and a part whose packing a probe of as many rows confirms."""
    layout = _layout()
    if layout is None or num_rows % layout.block == 0:
        return layout
    if num_rows % _OUT_MULTIPLE:
        return None
    probe, packed = _probe(num_rows, 64)
    rows = torch.arange(num_rows)
    if (torch.equal(layout.unpack(packed, num_rows, 64).to(torch.int32), probe)
            and torch.equal(layout.unpack_rows(packed, num_rows, 64, rows).to(torch.int32),
                            probe)):
        return layout
    return None


class QuantLinear(nn.Module):
    """y = x W^T + b with W quantized (inference only); replaces an nn.Linear."""

    def __init__(self, weight: QuantMatrix, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_q = weight
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        y = self.weight_q.matmul(x.reshape(-1, self.in_features))
        y = y if self.bias is None else y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class QuantEmbedding(nn.Module):
    """The vocabulary rows of a quantized weight (tensor parallelism: the rank's shard, tokens
    outside it zero, all-reduced), in `dtype`; replaces a (Vocab-parallel) nn.Embedding."""

    def __init__(self, weight: QuantMatrix, dtype: torch.dtype,
                 shard: VocabShard | None = None, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        if not weight.is_readable:
            raise ValueError("the rows of this CPU's int4 layout cannot be read")
        self.weight_q, self.dtype, self.shard, self.tp = weight, dtype, shard, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1 or self.shard is None:
            rows = self.weight_q.dequantize(self.dtype, input_ids.reshape(-1))
            return rows.view(*input_ids.shape, -1)
        local = input_ids - self.shard.start  # [N]
        is_mine = (local >= 0) & (local < self.shard.num_real)
        out = self.weight_q.dequantize(self.dtype, torch.where(is_mine, local, 0))
        out.mul_(is_mine.unsqueeze(1).to(out.dtype))
        return self.tp.all_reduce(out)
