"""The sampler's draw on the CPU (sampling.c): the worker's sampling_ops.draw in one C
call, two reads of each row of logits instead of torch's five passes and three
temporaries of their size."""

from __future__ import annotations

import torch

from gateway.models.kernels.cpu.library import load


def draw(logits: torch.Tensor, thresholds: torch.Tensor | None,
         uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """sampling_ops.draw in one call: logits [n, vocab] float32 (not modified),
    thresholds [n, 1] or None, uniforms [n] -> tokens [n] int64 and ok [n] bool; None
    where the kernels cannot take them (the caller runs torch's ops)."""
    library = load()
    if (library is None or logits.device.type != "cpu" or logits.dtype != torch.float32
            or logits.dim() != 2 or not logits.is_contiguous() or logits.shape[1] == 0):
        return None
    rows = logits.shape[0]
    limits = (None if thresholds is None
              else thresholds.reshape(rows).to(torch.float32).contiguous())
    draws = uniforms.reshape(rows).to(torch.float32).contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    ok = torch.empty(rows, dtype=torch.bool)
    status = library.gw_draw(logits.data_ptr(), rows, logits.shape[1],
                             None if limits is None else limits.data_ptr(), draws.data_ptr(),
                             tokens.data_ptr(), ok.data_ptr())
    if status != 0:
        raise MemoryError("the sampling kernel could not allocate its buffer")
    return tokens, ok
