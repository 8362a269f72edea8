"""GGUF quantized tensors kept quantized (worker process): Q4_0, Q4_1 and Q8_0 blocks as integer
codes with a scale and a minimum per group of 32 weights along the input dimension.

Every one of these types reads w = code * scale + minimum within a group:
  Q4_0: code 0..15,  scale d, minimum -8 d
  Q4_1: code 0..15,  scale d, minimum m
  Q8_0: code 0..255 (q + 128), scale d, minimum -128 d
so one representation serves them all, and tensor parallelism cuts it like a tensor: rows
anywhere, input columns on group boundaries. The K-quants (Q4_K, Q6_K, ...) and the 5-bit
types are not here: the loader dequantizes them (see `QuantWeight.from_gguf`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

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
