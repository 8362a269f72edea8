"""Faster linear layers on CPU, for the worker's models: weights pre-packed for oneDNN once,
at load.

`F.linear` on bf16 CPU tensors re-lays the weight out for oneDNN at every call; packing it
once (what torch.compile's CPU freezing does) saves that in every decode step's
matrix-vector products, and float32 gains over MKL at batch sizes above one. Used only
where the ops exist (and, for bf16, where the CPU computes it natively); elsewhere the
model keeps plain nn.Linear. Single rows take a transposed copy of the weight
(`PackedLinear`); docs/cpu-performance.md has the measurements behind these choices.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from gateway import envs
from gateway.logger import init_logger
from gateway.platforms.cpu_isa import cpu_isa

logger = init_logger(__name__)

# The batch size oneDNN tunes the packed layout for (any batch size runs).
_PACKING_BATCH_HINT = 32
_EXACT_ROWS = 16  # up to this many rows (decode of small batches) run unpadded
#: Outputs a block of a blocked single-row weight holds (DENSE_BLOCK in the C kernels).
ROW_BLOCK = 32


def padded_rows(num_rows: int) -> int:
    """The row count a packed linear runs `num_rows` at: exact up to 16, else rounded up to
    one of 8 steps per power of two (at most 12.5% more rows; ~50 sizes up to 2,048).

    oneDNN builds a primitive per input shape and keeps it in two caches (oneDNN's and
    ideep's, 1,024 entries each), and continuous batching gives almost every step its own
    token count: unpadded, the caches filled with one entry per count seen, and the engine
    core's memory kept growing after a warm-up (and re-creating primitives cost time). With
    few sizes the caches stay small and always hit."""
    if num_rows <= _EXACT_ROWS:
        return num_rows
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (inference only).

    A single row (a batch-1 decode step) is the exception in float32: the packed kernel is
    tuned for many rows, and MKL's matrix-vector product on the plain [out, in] weight streams
    memory slowly, while [1, in] @ [in, out] with [in, out] contiguous runs as a sum of scaled
    weight rows that streams it fast. So float32 layers keep the weight transposed too
    (`keep_row_weight`; off with GATEWAY_CPU_SINGLE_ROW_WEIGHTS=0, as it costs the weights'
    size once more). bfloat16 layers keep the copy only where the lone decode's one C call
    (models/kernels/cpu/lone_decode.py) reads it; their own single rows run the packed kernel.
    Where the call reads it, the copy is held in blocks of ROW_BLOCK outputs, [out / 32, in,
    32] (`block_row_weight`, when `out` is a multiple of 32), so each of the call's threads
    streams its share as one run of memory a block (`dense_blocks` in lone_decode.c).
    """

    def __init__(self, linear: nn.Linear, keep_row_weight: bool = False,
                 block_row_weight: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.shard_sizes = getattr(linear, "shard_sizes", None)
        # For single rows (see the class docstring): [in, out] contiguous, or blocked
        # [out / ROW_BLOCK, in, ROW_BLOCK]; None: packed only.
        self.row_weight_t: torch.Tensor | None = None
        if keep_row_weight:
            weight_t = weight.t()
            if block_row_weight and self.out_features % ROW_BLOCK == 0:
                weight_t = weight_t.reshape(self.in_features, -1, ROW_BLOCK).transpose(0, 1)
            self.row_weight_t = weight_t.contiguous()

    @property
    def row_weight_blocked(self) -> bool:
        """Whether the single-row copy is held in blocks of ROW_BLOCK outputs."""
        return self.row_weight_t is not None and self.row_weight_t.dim() == 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out], computed at `padded_rows(N)` rows."""
        num_rows = x.shape[0]
        row_weight_t = self.row_weight_t
        if (num_rows == 1 and row_weight_t is not None and x.dim() == 2
                and row_weight_t.dtype == torch.float32):
            if self.row_weight_blocked:  # [blocks, 1, ROW_BLOCK] in output order
                y = torch.matmul(x, row_weight_t).reshape(1, self.out_features)
                return y if self.bias is None else y + self.bias
            if self.bias is None:
                return torch.mm(x, row_weight_t)
            return torch.addmm(self.bias, x, row_weight_t)
        return onednn_linear(x, self.packed_weight, self.bias)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, in] W^T (+ bias) -> [N, out] through oneDNN, W packed (`PackedLinear`) or a plain
    [out, in] tensor, computed at `padded_rows(N)` rows. Plain weights too: oneDNN beats
    `F.linear` there, whose MKL takes a slower path on AMD CPUs (docs/cpu-performance.md);
    `can_pack` says where it runs."""
    num_rows = x.shape[0]
    rows = padded_rows(num_rows) if x.dim() == 2 else num_rows
    if rows != num_rows:
        x = nn.functional.pad(x, (0, 0, 0, rows - num_rows))
    y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return y if rows == num_rows else y[:num_rows]


@functools.cache
def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs here in `dtype` (`PackedLinear`, `onednn_linear`)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if dtype == torch.bfloat16 and not cpu_isa().has_onednn_bf16:
        return False
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def pack_linear_layers(model: nn.Module, dtype: torch.dtype, lone_decode: bool = True) -> int:
    """Replace every nn.Linear of `model` with a PackedLinear; returns how many.
    `lone_decode`: whether the one call may serve the model; only then are bfloat16 layers'
    transposed copies kept, and the copies held in blocks (see `PackedLinear`)."""
    keep_row_weight = envs.cpu_single_row_weights() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and lone_decode))
    replaced = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, PackedLinear(child, keep_row_weight, lone_decode))
                replaced += 1
    logger.debug("Packed %d linear layers for oneDNN%s", replaced,
                 " (transposed weights kept for single rows)" if keep_row_weight else "")
    return replaced
