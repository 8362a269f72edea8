"""Random weights quantized as GGUF stores them, for the tests of the quantized layers and
of the kernels that read them."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from gateway.models.layers.gguf_quant import BlockWeight, QuantWeight

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


# ---- The types kept in their file's blocks (K-quants, Q5_0, Q5_1), quantized here ----
# A plain quantizer of our own (a scale from each group's range, rounded to nearest; not
# llama.cpp's search for the best scales), writing the blocks as GGUF lays them out, so
# the tests check the layout against gguf-py's dequantizer and not against themselves.
BLOCK_KEPT = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.Q8_0]  # Q8_0: beside the others


def _half(values: np.ndarray) -> np.ndarray:
    """float16 values as their bytes, [..., 2]."""
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(
        *values.shape, 2)


def _k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """8 six-bit scales and minimums [B, 8] packed in Q4_K / Q5_K's 12 bytes [B, 12]."""
    out = np.zeros((scales.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = scales[:, j] | ((scales[:, j + 4] >> 4) << 6)
        out[:, j + 4] = mins[:, j] | ((mins[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (scales[:, j + 4] & 15) | ((mins[:, j + 4] & 15) << 4)
    return out


def _k_affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Super-blocks x [B, 256] as Q4_K / Q5_K codes [B, 256], 6-bit scales and minimums
    [B, 8], and d, dmin [B]."""
    groups = x.reshape(-1, 8, 32)
    low = np.minimum(groups.min(-1), 0)
    step = np.maximum((groups.max(-1) - low) / levels, 1e-8)
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = np.maximum((-low).max(-1) / 63, 1e-8).astype(np.float16).astype(np.float32)
    scales = np.clip(np.rint(step / d[:, None]), 1, 63).astype(np.uint8)
    mins = np.clip(np.rint(-low / dmin[:, None]), 0, 63).astype(np.uint8)
    scale = (d[:, None] * scales)[..., None]
    minimum = (dmin[:, None] * mins)[..., None]
    codes = np.clip(np.rint((groups + minimum) / scale), 0, levels).astype(np.uint8)
    return codes.reshape(-1, 256), scales, mins, d, dmin


def _blocks_q4_k(x: np.ndarray) -> np.ndarray:
    codes, scales, mins, d, dmin = _k_affine(x, 15)
    c = codes.reshape(-1, 4, 2, 32)
    qs = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate((_half(d), _half(dmin), _k_scales(scales, mins), qs), axis=1)


def _blocks_q5_k(x: np.ndarray) -> np.ndarray:
    codes, scales, mins, d, dmin = _k_affine(x, 31)
    c = codes.reshape(-1, 4, 2, 32)
    qs = ((c[:, :, 0] & 15) | ((c[:, :, 1] & 15) << 4)).reshape(-1, 128)
    high = (codes.reshape(-1, 8, 32) >> 4).astype(np.uint8)  # [B, sub-block, l]
    qh = np.zeros((codes.shape[0], 32), dtype=np.uint8)
    for s in range(8):
        qh |= high[:, s] << s
    return np.concatenate((_half(d), _half(dmin), _k_scales(scales, mins), qh, qs), axis=1)


def _blocks_q6_k(x: np.ndarray) -> np.ndarray:
    groups = x.reshape(-1, 16, 16)
    peak = np.abs(groups).max(-1)
    step = np.maximum(peak / 31, 1e-8)
    d = (step.max(-1) / 127).astype(np.float16).astype(np.float32)
    scales = np.clip(np.rint(step / d[:, None]), 1, 127).astype(np.int8)
    codes = np.clip(np.rint(groups / (d[:, None] * scales)[..., None]), -32, 31) + 32
    q = codes.astype(np.uint8).reshape(-1, 2, 4, 32)  # [B, half, quarter, l]
    ql = np.concatenate(((q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)), axis=2)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) \
        | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate((ql.reshape(-1, 128), qh.reshape(-1, 64),
                           scales.view(np.uint8), _half(d)), axis=1)


def _blocks_q5(x: np.ndarray, with_minimum: bool) -> np.ndarray:
    groups = x.reshape(-1, 32)
    if with_minimum:
        low = groups.min(-1)
        d = np.maximum((groups.max(-1) - low) / 31, 1e-8).astype(np.float16).astype(np.float32)
        low = low.astype(np.float16).astype(np.float32)
        codes = np.clip(np.rint((groups - low[:, None]) / d[:, None]), 0, 31)
    else:
        d = np.maximum(np.abs(groups).max(-1) / 16, 1e-8).astype(np.float16).astype(np.float32)
        codes = np.clip(np.rint(groups / d[:, None]) + 16, 0, 31)
    c = codes.astype(np.uint32)
    qs = ((c[:, :16] & 15) | ((c[:, 16:] & 15) << 4)).astype(np.uint8)
    qh = ((c >> 4) << np.arange(32, dtype=np.uint32)).sum(-1).astype(np.uint32)
    head = [_half(d), _half(low)] if with_minimum else [_half(d)]
    return np.concatenate((*head, qh[:, None].view(np.uint8), qs), axis=1)


def quantize_blocks(values: np.ndarray, qtype: Q) -> np.ndarray:
    """values [rows, cols] float32 as `qtype`'s blocks, [rows, row bytes] uint8."""
    rows = values.shape[0]
    if qtype == Q.Q8_0:
        return gguf.quants.quantize(values, qtype)
    flat = values.reshape(-1, 32 if qtype in (Q.Q5_0, Q.Q5_1) else 256)
    if qtype == Q.Q4_K:
        blocks = _blocks_q4_k(flat)
    elif qtype == Q.Q5_K:
        blocks = _blocks_q5_k(flat)
    elif qtype == Q.Q6_K:
        blocks = _blocks_q6_k(flat)
    else:
        blocks = _blocks_q5(flat, qtype == Q.Q5_1)
    return np.ascontiguousarray(blocks).reshape(rows, -1)


def block_weight(qtype: Q, rows: int = 96, cols: int = 512,
                 seed: int = 0) -> tuple[BlockWeight, torch.Tensor]:
    """A [rows, cols] weight of random values in `qtype`'s blocks, and gguf-py's
    dequantization of it (float32)."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize_blocks(values, qtype)
    weight = BlockWeight.from_gguf(raw.reshape(-1), qtype, (rows, cols))
    assert weight is not None
    return weight, torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, cols))
