"""The gated MLP of the worker's decoders: down(act(gate) * up), gate and up in one matmul.

With tensor parallelism each rank holds a slice of the intermediate size (gate/up
column-parallel, down row-parallel) and all-reduces after down_proj (parallel.py).
SiLU's `silu(gate) * up` runs in one pass of the gateway's kernels on the CPU.

Shapes: N tokens, E hidden size, I the rank's intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gateway.models.kernels.cpu import elementwise
from gateway.models.layers.parallel import (
    MergedLinear,
    RowParallelLinear,
    TensorParallel,
    rank_slice,
)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    act = elementwise.silu_mul(gate_up)  # on the CPU: one pass
    if act is None:
        size = gate_up.shape[-1] // 2
        act = F.silu(gate_up[:, :size]).mul_(gate_up[:, size:])
    return act


def _gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    size = gate_up.shape[-1] // 2
    return F.gelu(gate_up[:, :size], approximate="tanh").mul_(gate_up[:, size:])


#: config.json's activation name -> gate_up [N, 2 I] -> act(gate) * up [N, I].
GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": _silu_mul, "gelu_pytorch_tanh": _gelu_tanh_mul}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str,
                 tp: TensorParallel) -> None:
        super().__init__()
        part = rank_slice(intermediate_size, tp)
        self.gate_up_proj = MergedLinear(hidden_size, (part.size, part.size), bias=bias,
                                         row_starts=(part.start, part.start),
                                         full_sizes=(intermediate_size, intermediate_size))
        self.down_proj = RowParallelLinear(part, hidden_size, bias=bias, tp=tp)
        self.act_mul = GATED_ACTIVATIONS[act]
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [N, 2 I]: gate, up
        return self.tp.all_reduce(self.down_proj(self.act_mul(gate_up)))  # [N, E]
