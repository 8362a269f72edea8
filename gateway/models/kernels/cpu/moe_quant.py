"""A mixture of experts' stacked weights kept quantized in the gateway's CPU kernels, and
their grouped product (moe_quant.c): the rows routed to the experts, sorted by expert,
each times its own expert's weight, every expert in one C call.

Q4_0 and Q4_1 are held in the kernels' layout (Float32QuantWeight's: codes, half-float
scales and minimums; Q4_0 takes 20 bytes a block of 32 where its file takes 18), the
other types in their file's blocks (BlockQuantWeight's). The reference the tests compare
it with is layers/moe.py's grouped_linear of the dequantized stack.
"""

from __future__ import annotations

import ctypes

import torch
from gguf import GGMLQuantizationType

from gateway.models.kernels.cpu.quant_weight import Float32QuantWeight
from gateway.models.layers.gguf_quant import QuantWeight, StackedExperts

_Q = GGMLQuantizationType
_CODE_TYPES = frozenset({_Q.Q4_0, _Q.Q4_1})  # held as Float32QuantWeight holds them


class _Weight(ctypes.Structure):  # moe_quant.c's gw_moe_weight
    _fields_ = [("type", ctypes.c_int64), ("data", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("minimums", ctypes.c_void_p)]


class ExpertsWeight:
    """The stacked weights [experts, N, K] of one projection, for gw_moe_quant_matmul."""

    def __init__(self, stack: StackedExperts, library: ctypes.CDLL) -> None:
        experts, rows, cols = stack.shape
        if stack.qtype in _CODE_TYPES:
            flat = QuantWeight.from_gguf(stack.blocks.numpy().reshape(-1), stack.qtype,
                                         (experts * rows, cols))
            assert flat is not None  # a type QuantWeight reads
            kernel = Float32QuantWeight(flat, library)
            self.tensors: tuple[torch.Tensor, ...] = (kernel.codes, kernel.scales,
                                                      kernel.minimums)
        else:
            self.tensors = (stack.blocks.contiguous(),)
        pointers = [tensor.data_ptr() for tensor in self.tensors]
        self.record = _Weight(int(stack.qtype), *pointers, *[None] * (3 - len(pointers)))
        self.address = ctypes.addressof(self.record)
        self.qtype, self.shape = stack.qtype, stack.shape
        self._library = library

    def matmul(self, rows: torch.Tensor, offsets: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """rows [M, K] sorted by expert, offsets [experts] int32 (the end of each expert's
        rows) -> [M, N] float32: each row times its expert's weight, transposed; written
        into `out` ([M, N] float32, its columns adjacent) where given."""
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
            num_out, out.data_ptr(), out.stride(0))
        if status != 0:
            raise MemoryError("the experts' quantized matmul kernel could not allocate "
                              "its buffers")
        return out

    def num_bytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)
