"""GGUF tensors kept quantized (worker process). Q4_0, Q4_1 and Q8_0 as integer codes with a
scale and a minimum per group of 32 input columns (`QuantWeight`): each reads w = code *
scale + minimum (Q4_0: code 0..15, minimum -8 d; Q4_1: code 0..15, minimum m; Q8_0: code
q + 128, minimum -128 d), so one representation serves them all. The K-quants (Q4_K, Q5_K,
Q6_K), Q5_0 and Q5_1 stay in their file's blocks (`BlockWeight`), as does Q8_0 in a file
with those (a fused q/k/v may mix them). Tensor parallelism cuts either like a tensor: rows
anywhere, input columns on group or block boundaries. A mixture of experts' stacked
experts of any of these types are kept as the file holds them (`StackedExperts`). Other
types are dequantized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

GROUP_SIZE = 32  # weights per scale along the input dimension, in all three types
_Q = GGMLQuantizationType
# bytes per block of 32: fp16 scale (+ fp16 minimum for Q4_1), then the codes
_BLOCK_BYTES = {_Q.Q4_0: 18, _Q.Q4_1: 20, _Q.Q8_0: 34}
KEPT_TYPES = frozenset(_BLOCK_BYTES)


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight as codes [N, K] uint8, scale and minimum [N, K / 32] float32."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    bits: int  # 4 or 8: the codes' range

    @classmethod
    def from_gguf(cls, raw: np.ndarray, qtype: GGMLQuantizationType,
                  shape: tuple[int, ...]) -> QuantWeight | None:
        """The tensor of `qtype` in the bytes `raw` (shape [N, K], numpy order); None for a
        type not kept quantized (the caller dequantizes it)."""
        if qtype not in _BLOCK_BYTES or len(shape) != 2:
            return None
        rows, cols = shape
        blocks = raw.reshape(rows, cols // GROUP_SIZE, _BLOCK_BYTES[qtype])
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if qtype == _Q.Q8_0:
            codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return cls._of(codes, scale, -128 * scale, 8)
        packed = blocks[..., 4:] if qtype == _Q.Q4_1 else blocks[..., 2:]  # [N, G, 16]
        # a block's 16 bytes hold weights 0..15 in their low nibbles, 16..31 in the high
        codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1)
        if qtype == _Q.Q4_1:
            minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:
            minimum = -8 * scale
        return cls._of(codes, scale, minimum, 4)

    @classmethod
    def _of(cls, codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray,
            bits: int) -> QuantWeight:
        rows = codes.shape[0]
        return cls(torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)),
                   torch.from_numpy(np.ascontiguousarray(scale)),
                   torch.from_numpy(np.ascontiguousarray(minimum)), bits)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, as llama.cpp (and gguf-py) dequantize it."""
        rows, cols = self.shape
        grouped = self.codes.view(rows, -1, GROUP_SIZE).float()
        values = grouped * self.scale.unsqueeze(-1) + self.minimum.unsqueeze(-1)
        return values.view(rows, cols)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantWeight:
        """The weight with `fn` (a permutation or selection of rows) applied to every part."""
        return QuantWeight(fn(self.codes), fn(self.scale), fn(self.minimum), self.bits)

    def narrow(self, dim: int, start: int, length: int) -> QuantWeight:
        """Rows (dim 0) or input columns (dim 1, on group boundaries) [start, start + length),
        as `torch.Tensor.narrow`; columns off the groups raise ValueError."""
        if dim == 0:
            return self.map_rows(lambda part: part.narrow(0, start, length))
        if start % GROUP_SIZE or length % GROUP_SIZE:
            raise ValueError(f"input columns [{start}, {start + length}) do not fall on "
                             f"the quantization groups of {GROUP_SIZE}")
        first, num = start // GROUP_SIZE, length // GROUP_SIZE
        return QuantWeight(self.codes.narrow(1, start, length), self.scale.narrow(1, first, num),
                           self.minimum.narrow(1, first, num), self.bits)

    @staticmethod
    def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
        """Weights of one input stacked by rows (q, k, v -> qkv); the wider code range wins."""
        return QuantWeight(torch.cat([p.codes for p in parts]),
                           torch.cat([p.scale for p in parts]),
                           torch.cat([p.minimum for p in parts]), max(p.bits for p in parts))


# (columns, bytes) of a block of the types kept in their file's blocks
_FILE_BLOCKS = {_Q.Q5_0: (32, 22), _Q.Q5_1: (32, 24), _Q.Q4_K: (256, 144),
                _Q.Q5_K: (256, 176), _Q.Q6_K: (256, 210), _Q.Q8_0: (32, 34)}
#: The types only the block kernels run; a file with one keeps its Q8_0 in blocks too.
BLOCK_KEPT_TYPES = frozenset(_FILE_BLOCKS) - {_Q.Q8_0}
MAX_BLOCK_PARTS = 4  # parts of one weight the kernels take (kquant.h's KQ_MAX_PARTS)


@dataclass(frozen=True)
class BlockPart:
    """Whole rows of one type: blocks [rows, row bytes] uint8, as the file holds them."""

    qtype: GGMLQuantizationType
    blocks: torch.Tensor

    def dequantize(self, cols: int) -> torch.Tensor:
        """[rows, cols] float32, by gguf-py's dequantizer."""
        values = gguf_quants.dequantize(self.blocks.numpy(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values)).view(-1, cols)


@dataclass(frozen=True)
class BlockWeight:
    """A [N, K] weight of K-quant (or Q5_0, Q5_1) blocks kept as the file holds them, in one
    or more parts of whole rows (a fused q/k/v whose v has another type)."""

    parts: tuple[BlockPart, ...]
    cols: int

    @classmethod
    def from_gguf(cls, raw: np.ndarray, qtype: GGMLQuantizationType,
                  shape: tuple[int, ...]) -> BlockWeight | None:
        """The tensor of `qtype` in the bytes `raw` (shape [N, K], numpy order), copied out
        of the memory map; None for a type not kept in its blocks."""
        if qtype not in _FILE_BLOCKS or len(shape) != 2:
            return None
        rows, cols = shape
        values, size = _FILE_BLOCKS[qtype]
        blocks = torch.from_numpy(np.array(raw).reshape(rows, cols // values * size))
        return cls((BlockPart(qtype, blocks),), cols)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(int(p.blocks.shape[0]) for p in self.parts), self.cols

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, as llama.cpp (and gguf-py) dequantize it."""
        return torch.cat([part.dequantize(self.cols) for part in self.parts])

    def _only(self) -> BlockPart:
        if len(self.parts) != 1:
            raise ValueError("a weight of several block types cannot be cut")
        return self.parts[0]

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockWeight:
        """The weight with `fn` (a permutation or selection of rows) applied to its blocks."""
        part = self._only()
        return BlockWeight((BlockPart(part.qtype, fn(part.blocks)),), self.cols)

    def narrow(self, dim: int, start: int, length: int) -> BlockWeight:
        """Rows (dim 0) or input columns (dim 1, on block boundaries) [start, start +
        length), as `torch.Tensor.narrow`; columns off the blocks raise ValueError."""
        if dim == 0:
            return self.map_rows(lambda blocks: blocks.narrow(0, start, length))
        part = self._only()
        values, size = _FILE_BLOCKS[part.qtype]
        if start % values or length % values:
            raise ValueError(f"input columns [{start}, {start + length}) do not fall on "
                             f"the {part.qtype.name} blocks of {values}")
        blocks = part.blocks.narrow(1, start // values * size, length // values * size)
        return BlockWeight((BlockPart(part.qtype, blocks.contiguous()),), length)

    @staticmethod
    def cat_rows(weights: list[BlockWeight]) -> BlockWeight:
        """Weights of one input stacked by rows (q, k, v -> qkv); adjacent parts of one type
        merge."""
        parts: list[BlockPart] = []
        for weight in weights:
            for part in weight.parts:
                if parts and parts[-1].qtype == part.qtype:
                    parts[-1] = BlockPart(part.qtype, torch.cat((parts[-1].blocks, part.blocks)))
                else:
                    parts.append(part)
        return BlockWeight(tuple(parts), weights[0].cols)


#: A GGUF tensor kept quantized, in either representation.
KeptWeight = QuantWeight | BlockWeight


def kept_from_gguf(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                   file_has_blocks: bool) -> KeptWeight | None:
    """The tensor kept quantized (`QuantWeight`, or `BlockWeight` for the block types and,
    where `file_has_blocks` (a type of BLOCK_KEPT_TYPES in the file), for Q8_0), or None
    for a type the loader dequantizes."""
    if qtype in BLOCK_KEPT_TYPES or (file_has_blocks and qtype == _Q.Q8_0):
        return BlockWeight.from_gguf(raw, qtype, shape)
    return QuantWeight.from_gguf(raw, qtype, shape)


#: The types of a mixture of experts' stacked experts kept quantized (kernels/cpu/moe_quant.py).
EXPERT_KEPT_TYPES = KEPT_TYPES | frozenset(_FILE_BLOCKS)


@dataclass(frozen=True)
class StackedExperts:
    """A GGUF's experts of one projection, stacked [experts, N, K] (ffn_gate_exps,
    ffn_up_exps, ffn_down_exps): blocks [experts, N, row bytes] uint8, as the file holds
    them."""

    qtype: GGMLQuantizationType
    blocks: torch.Tensor
    cols: int

    @classmethod
    def from_gguf(cls, raw: np.ndarray, qtype: GGMLQuantizationType,
                  shape: tuple[int, ...]) -> StackedExperts | None:
        """The stack of `qtype` in the bytes `raw` (shape [experts, N, K], numpy order),
        copied out of the memory map; None for a type not kept quantized."""
        if qtype not in EXPERT_KEPT_TYPES or len(shape) != 3:
            return None
        experts, rows, cols = shape
        values, size = GGML_QUANT_SIZES[qtype]
        blocks = np.array(raw).reshape(experts, rows, cols // values * size)
        return cls(qtype, torch.from_numpy(blocks), cols)

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, rows, _ = self.blocks.shape
        return int(experts), int(rows), self.cols

    def dequantize(self) -> torch.Tensor:
        """[experts, N, K] float32, by gguf-py's dequantizer."""
        values = gguf_quants.dequantize(self.blocks.numpy(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values)).view(self.shape)

    def num_bytes(self) -> int:
        return self.blocks.numel()
