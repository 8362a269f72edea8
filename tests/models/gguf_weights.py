"""Random weights quantized as GGUF stores them, for the tests of the quantized layers and
of the kernels that read them."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from gateway.models.layers.gguf_quant import QuantWeight

Q = gguf.GGMLQuantizationType
KEPT = [Q.Q4_0, Q.Q4_1, Q.Q8_0]  # the types that stay quantized


def quantized_weight(qtype: Q, rows: int = 96,
                     cols: int = 256) -> tuple[QuantWeight, torch.Tensor]:
    """A [rows, cols] weight of random values quantized as `qtype`, and gguf-py's
    dequantization of it (float32)."""
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    weight = QuantWeight.from_gguf(raw.reshape(-1).view(np.uint8), qtype, (rows, cols))
    assert weight is not None
    return weight, torch.from_numpy(gguf.quants.dequantize(raw, qtype))
