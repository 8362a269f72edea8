"""A mixture of experts' experts kept quantized on the CPU (worker process): a GGUF's
stacked ffn_{gate,up,down}_exps in their file's types, in place of FusedExperts' float
weights, the loader swapping them in (loading/quantized.py) with one rank on the CPU.

The step is FusedExperts': the (token, expert) pairs sorted by expert, gate and up, the
activation, down, the router's weights. Each projection is one C call for every expert
(kernels/cpu/moe_quant.py), computed in float32 from the codes (in a bfloat16 model, an
expert of many rows in bfloat16 where the CPU has AVX512-BF16); nothing in Python runs per
expert. Shapes: N tokens, k chosen experts, E hidden size, I the experts' intermediate size.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

from gateway.models.kernels.cpu.moe_quant import ExpertsWeight
from gateway.models.layers.gguf_quant import StackedExperts
from gateway.models.layers.moe import ExpertGroups


class QuantExperts(nn.Module):
    """Every expert's gate and up [experts, I, E] and down [experts, E, I], quantized."""

    def __init__(self, gate: StackedExperts, up: StackedExperts, down: StackedExperts,
                 act_mul: Callable[[torch.Tensor], torch.Tensor],
                 library: ctypes.CDLL) -> None:
        super().__init__()
        experts, size, hidden = gate.shape
        if up.shape != gate.shape or down.shape != (experts, hidden, size):
            raise ValueError(f"the experts' shapes disagree: gate {list(gate.shape)}, up "
                             f"{list(up.shape)}, down {list(down.shape)}")
        self.num_experts, self.size = experts, size
        self.gate_proj, self.up_proj, self.down_proj = (
            ExpertsWeight(stack, library) for stack in (gate, up, down))
        self.act_mul = act_mul

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
        """x [N, E], weights and experts [N, k] -> [N, E]."""
        groups = ExpertGroups.of(experts, self.num_experts)
        rows = x.index_select(0, groups.tokens).to(torch.float32)  # [N k, E]
        bfloat16 = x.dtype == torch.bfloat16
        gate_up = rows.new_empty(rows.shape[0], 2 * self.size)
        self.gate_proj.matmul(rows, groups.offsets, gate_up[:, :self.size], bfloat16)
        self.up_proj.matmul(rows, groups.offsets, gate_up[:, self.size:], bfloat16)
        out = self.down_proj.matmul(self.act_mul(gate_up), groups.offsets,
                                    bfloat16=bfloat16)  # [N k, E]
        return groups.combine(out, weights, x)

    def num_bytes(self) -> int:
        """Bytes of the quantized weights as held."""
        return sum(weight.num_bytes() for weight in (self.gate_proj, self.up_proj,
                                                     self.down_proj))

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={weight.qtype.name}{list(weight.shape)}" for name, weight in
                         (("gate", self.gate_proj), ("up", self.up_proj),
                          ("down", self.down_proj)))
