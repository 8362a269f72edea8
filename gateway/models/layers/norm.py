"""RMS norms of the worker's decoders: Llama's, and Gemma's that scales by (1 + weight).

`add_and_norm` sums a delta into the residual stream and norms the result; on the CPU,
Llama's norm does both in one pass of the gateway's kernels (models/kernels/cpu/
elementwise.py), any other norm through torch's ops.

Shapes: R rows, E their size (the hidden size, or a head dim for q/k norms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gateway.models.kernels.cpu import elementwise


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one call instead of HF's seven ops (same sums)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # As HF computes it: normalise in float32, round to the input dtype, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """x [R, E] += delta in place (x is the residual stream; no delta: nothing to add),
        then the norm of x: on the CPU in one pass of the gateway's kernels."""
        if type(self) is RMSNorm:  # the kernel's norm is this class's, not a subclass's
            out = elementwise.add_rms_norm(x, delta, self.weight, self.eps)
            if out is not None:
                return out
        return self(x if delta is None else x.add_(delta))


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), in float32, then rounds to the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)
