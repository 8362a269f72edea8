"""The elementwise steps of a many-row step on the CPU (elementwise.c), run by the worker's
decoder layers (models/layers: norm.py, mlp.py, rotary.py): the residual add with the RMS
norm after it, silu(gate) * up, and the rotary embedding, each in one pass over its rows.

float32 and bfloat16 rows only; anything else (or no library, or another device) gets None
(or False) and the caller runs torch's ops.
"""

from __future__ import annotations

import ctypes

import torch

from gateway.models.kernels.cpu.library import load

_ROW_DTYPES = (torch.float32, torch.bfloat16)


def _rows_library(x: torch.Tensor) -> ctypes.CDLL | None:
    if x.device.type != "cpu" or x.dtype not in _ROW_DTYPES:
        return None
    return load()


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """x [R, E], the residual stream: adds `delta` into it in place (if given), then
    returns its RMS norm times `weight`, in one pass; None where the kernels do not take
    these tensors (nothing is changed then)."""
    library = _rows_library(x)
    if (library is None or x.dim() != 2 or not x.is_contiguous() or weight.dtype != x.dtype
            or not weight.is_contiguous() or weight.shape != x.shape[1:]
            or (delta is not None and (delta.dtype != x.dtype or delta.shape != x.shape
                                       or not delta.is_contiguous()))):
        return None
    out = torch.empty_like(x)
    status = library.gw_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                                     weight.data_ptr(), x.shape[0], x.shape[1], eps,
                                     int(x.dtype == torch.bfloat16), out.data_ptr())
    return out if status == 0 else None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [R, 2 I] -> silu(gate) * up [R, I] in one pass; None where the kernels do
    not take it."""
    library = _rows_library(gate_up)
    if library is None or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inter))
    status = library.gw_silu_mul(gate_up.data_ptr(), rows, inter,
                                 int(gate_up.dtype == torch.bfloat16), out.data_ptr())
    return out if status == 0 else None


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [N, heads, D] (its heads contiguous within a row, rows at any stride) rotated in
    place by cos, sin [N, 1, D]; False (x untouched) where the kernels do not take them."""
    library = _rows_library(x)
    if (library is None or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]
            or cos.dtype != x.dtype or sin.dtype != x.dtype
            or cos.shape != (x.shape[0], 1, x.shape[2]) or sin.shape != cos.shape
            or not cos.is_contiguous() or not sin.is_contiguous()):
        return False
    return library.gw_rotary(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2],
                             cos.data_ptr(), sin.data_ptr(),
                             int(x.dtype == torch.bfloat16)) == 0
