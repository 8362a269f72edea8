"""The rotary position embedding of the worker's decoders, in HF's half-split layout
(rotate_half): inverse frequencies with rope scaling ("linear", "llama3") and llama.cpp's
per-frequency factors, cos/sin tables, and the rotation applied in place.

Shapes: N tokens, D the rotated dims of a head (the head dim, or less: partial rotary).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gateway.models.kernels.cpu import elementwise


def rope_inverse_frequencies(dim: int, theta: float, scaling: dict[str, Any] | None = None,
                             freq_factors: list[float] | None = None) -> torch.Tensor:
    """[D / 2] float32 inverse frequencies of `dim` rotated dims, with rope `scaling`
    (config.json's dict; None: none) and llama.cpp's rope_freqs `freq_factors`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif rope_type not in ("default", None):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported "
                         f"(supported: none, linear, llama3)")
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos and signed sin tables [max_positions, D], built on first use on the model's
    device."""

    def __init__(self, dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None,
                 freq_factors: list[float] | None = None) -> None:
        super().__init__()
        self.dim, self.max_positions = dim, max_positions
        self.theta, self.scaling, self.freq_factors = theta, scaling, freq_factors
        # An unsupported rope type fails at load, not later. On the CPU: the model is built
        # on the meta device, where these ops would import torch._dynamo (slow; see
        # docs/cpu-performance.md).
        with torch.device("cpu"):
            self._inverse_frequencies()
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _inverse_frequencies(self) -> torch.Tensor:
        return rope_inverse_frequencies(self.dim, self.theta, self.scaling, self.freq_factors)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [N, 1, D] for `positions` [N]; sin's first half is negated."""
        if self._tables is None or self._tables[0].dtype != dtype:
            inv_freq = self._inverse_frequencies().to(positions.device)
            steps = torch.arange(self.max_positions, dtype=torch.float32,
                                 device=positions.device)
            freqs = torch.outer(steps, inv_freq)  # [max_positions, D / 2]
            cos, sin = freqs.cos(), freqs.sin()
            self._tables = (torch.cat((cos, cos), dim=-1).to(dtype),
                            torch.cat((-sin, sin), dim=-1).to(dtype))
        cos, sin = self._tables
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated in place in HF's half-split layout: x * cos + rotate_half(x)
    * sin, with rotate_half(x) * sin = [x2, x1] * [-sin, sin] (`sin` comes signed; rolling
    the last dim by D / 2 gives [x2, x1] in one op)."""
    if elementwise.rotary_(x, cos, sin):  # on the CPU: one pass, no copy of x
        return x
    swapped = x.roll(x.shape[-1] // 2, -1)
    return x.mul_(cos).addcmul_(swapped, sin)
