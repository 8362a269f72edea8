"""A mixture of experts' stacked weights kept quantized in the gateway's CPU kernels, and
their grouped product (moe_quant.c): the rows routed to the experts, sorted by expert,
each times its own expert's weight, every expert in one C call.

Q4_0 and Q4_1 are held in the kernels' layout (Float32QuantWeight's: codes, half-float
scales and minimums; Q4_0 takes 20 bytes a block of 32 where its file takes 18), cut from
the file's blocks without a larger copy between, the other types in their file's blocks
(BlockQuantWeight's). The torch reference the tests compare it with is layers/moe.py's
gathered_linear of the stack dequantized (StackedExperts.dequantize).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from gguf import GGMLQuantizationType

from gateway.models.layers.gguf_quant import StackedExperts

_Q = GGMLQuantizationType
_CODE_TYPES = frozenset({_Q.Q4_0, _Q.Q4_1})  # held as Float32QuantWeight holds them


class _Weight(ctypes.Structure):  # moe_quant.c's gw_moe_weight
    _fields_ = [("type", ctypes.c_int64), ("data", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("minimums", ctypes.c_void_p)]


def _codes_layout(stack: StackedExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 or Q4_1 stack in quant.h's layout, [experts N, K / 32, ...]: its codes (the
    file's 16 bytes a block, already in that order), scales and minimums (Q4_0's: -8 scale,
    exact in half floats below 8188), cut from the blocks without unpacking them."""
    experts, rows, cols = stack.shape
    blocks = stack.blocks.numpy().reshape(experts * rows, cols // 32, -1)
    halves = blocks[..., :4].copy().view(np.float16)  # d, and Q4_1's m
    scales = np.ascontiguousarray(halves[..., 0])
    if stack.qtype == _Q.Q4_1:
        codes, minimums = blocks[..., 4:], np.ascontiguousarray(halves[..., 1])
    else:
        codes, minimums = blocks[..., 2:18], scales * np.float16(-8)
        if not np.isfinite(minimums).all():
            raise ValueError("a Q4_0 scale is too large for its minimum in a half float")
    parts = [torch.from_numpy(np.ascontiguousarray(part))
             for part in (codes, scales.view(np.uint16), minimums.view(np.uint16))]
    return parts[0], parts[1], parts[2]


class ExpertsWeight:
    """The stacked weights [experts, N, K] of one projection, for gw_moe_quant_matmul."""

    def __init__(self, stack: StackedExperts, library: ctypes.CDLL) -> None:
        experts, rows, cols = stack.shape
        if stack.qtype in _CODE_TYPES:
            self.tensors: tuple[torch.Tensor, ...] = _codes_layout(stack)
        else:
            self.tensors = (stack.blocks.contiguous(),)
        pointers = [tensor.data_ptr() for tensor in self.tensors]
        self.record = _Weight(int(stack.qtype), *pointers, *[None] * (3 - len(pointers)))
        self.address = ctypes.addressof(self.record)
        self.qtype, self.shape = stack.qtype, stack.shape
        self._library = library

    def matmul(self, rows: torch.Tensor, offsets: torch.Tensor,
               out: torch.Tensor | None = None, bfloat16: bool = False) -> torch.Tensor:
        """rows [M, K] sorted by expert, offsets [experts] int32 (the end of each expert's
        rows) -> [M, N] float32: each row times its expert's weight, transposed; written
        into `out` ([M, N] float32, its columns adjacent) where given. `bfloat16`: the
        model runs in bfloat16, so an expert of many rows may be multiplied in bfloat16
        (its rows rounded, its weight dequantized to bfloat16) on a CPU with AVX512-BF16;
        else every product is float32 from the codes."""
        experts, num_out, cols = self.shape
        if rows.dim() != 2 or rows.shape[1] != cols or rows.device.type != "cpu":
            raise ValueError(f"expected CPU rows [M, {cols}], got {list(rows.shape)} on "
                             f"{rows.device}")  # the C code trusts the shapes
        if offsets.shape != (experts,) or offsets.dtype != torch.int32 \
                or (experts and int(offsets[-1]) != rows.shape[0]):
            raise ValueError(f"offsets must be the int32 ends of {experts} experts' rows")
        x = rows.to(torch.float32).contiguous()
        offsets = offsets.contiguous()
        if out is None:
            out = torch.empty(x.shape[0], num_out, dtype=torch.float32)
        if out.shape != (x.shape[0], num_out) or out.dtype != torch.float32 \
                or out.stride(1) != 1:
            raise ValueError(f"out must be float32 [{x.shape[0]}, {num_out}], its columns "
                             "adjacent")
        status = self._library.gw_moe_quant_matmul(
            x.data_ptr(), x.shape[0], cols, offsets.data_ptr(), experts, self.address,
            num_out, out.data_ptr(), out.stride(0), int(bfloat16))
        if status != 0:
            raise MemoryError("the experts' quantized matmul kernel could not allocate "
                              "its buffers")
        return out

    def num_bytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)
