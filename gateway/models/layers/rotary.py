"""The rotary position embedding of the worker's decoders, in HF's half-split layout
(rotate_half): inverse frequencies with rope scaling ("linear", "dynamic", "yarn",
"longrope", "llama3") and llama.cpp's per-frequency factors, cos/sin tables (times yarn's
and longrope's attention factor), and the rotation applied in place.

Shapes: N tokens, D the rotated dims of a head (the head dim, or less: partial rotary).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gateway.models.kernels.cpu import elementwise


def _base_frequencies(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _dynamic(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """NTK-aware scaling with the base of a context of original * factor positions (what
    transformers recomputes at that length)."""
    factor = float(scaling["factor"])
    base = theta * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
    return _base_frequencies(dim, base)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Interpolated (divided by factor) below the dims that turn fewer than beta_slow times
    in the original context, extrapolated (kept) above beta_fast turns, a linear ramp
    between; and the attention factor the cos/sin tables are scaled by."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(turns: float) -> float:  # the dim that turns `turns` times in `original`
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = _base_frequencies(dim, theta)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) \
            if mscale and mscale_all_dim else yarn_mscale(factor)
    return inv_freq, float(attention)


def _longrope(dim: int, theta: float, scaling: dict[str, Any],
              max_positions: int) -> tuple[torch.Tensor, float]:
    original = int(scaling["original_max_position_embeddings"])
    key = "long_factor" if max_positions > original else "short_factor"
    inv_freq = _base_frequencies(dim, theta) / torch.tensor(scaling[key], dtype=torch.float32)
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = float(scaling["factor"])
        attention = 1.0 if factor <= 1 else \
            math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(attention)


def rope_frequencies(dim: int, theta: float, scaling: dict[str, Any] | None = None,
                     freq_factors: list[float] | None = None,
                     max_positions: int = 0) -> tuple[torch.Tensor, float]:
    """([D / 2] float32 inverse frequencies, the factor cos and sin are scaled by) of `dim`
    rotated dims, with rope `scaling` (None: none), llama.cpp's rope_freqs `freq_factors`,
    for a table of `max_positions`.

    `scaling` is config.json's dict as models/info/decoder_config.py completes it (with
    "original_max_position_embeddings" for dynamic, yarn and longrope, and longrope's
    "factor"). Two choices are made once for the whole table, as vLLM does: "dynamic" uses
    the base of its longest context (original * factor), and "longrope" its long factors
    when the table (the served context) reaches past the original context."""
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    inv_freq, attention = _base_frequencies(dim, theta), 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif rope_type == "dynamic":
        inv_freq = _dynamic(dim, theta, scaling)
    elif rope_type == "yarn":
        inv_freq, attention = _yarn(dim, theta, scaling)
    elif rope_type == "longrope":
        inv_freq, attention = _longrope(dim, theta, scaling, max_positions)
    elif rope_type not in ("default", None):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported "
                         f"(supported: none, linear, dynamic, yarn, longrope, llama3)")
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    return inv_freq, attention


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
            self._frequencies()
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def fit_positions(self, max_positions: int) -> None:
        """Size the tables to the served context (which also picks longrope's factors)."""
        self.max_positions, self._tables = max_positions, None

    def _frequencies(self) -> tuple[torch.Tensor, float]:
        return rope_frequencies(self.dim, self.theta, self.scaling, self.freq_factors,
                                self.max_positions)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [N, 1, D] for `positions` [N]; sin's first half is negated."""
        if self._tables is None or self._tables[0].dtype != dtype:
            inv_freq, attention = self._frequencies()
            steps = torch.arange(self.max_positions, dtype=torch.float32,
                                 device=positions.device)
            freqs = torch.outer(steps, inv_freq.to(positions.device))  # [max_positions, D / 2]
            cos, sin = freqs.cos() * attention, freqs.sin() * attention
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
