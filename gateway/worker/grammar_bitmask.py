"""Structured outputs in the worker: the engine core's token bitmask applied to the logits
of the constrained rows, so constrained and free requests share one batch.

The engine core fills the mask (gateway/engine/structured_output/); the worker only reads
it, so it needs no grammar library. On a GPU the packed words are unpacked there.
"""

from __future__ import annotations

import numpy as np
import torch

from gateway.messages import SchedulerOutput
from gateway.worker.host_buffers import to_device


def apply_grammar_bitmask(logits: torch.Tensor, req_ids: list[str],
                          scheduler_output: SchedulerOutput) -> None:
    """Set to -inf, in place, every logit a grammar forbids.

    logits: [R, vocab], row i belonging to req_ids[i]; rows of requests without a grammar
    are left alone."""
    if scheduler_output.grammar_bitmask is None or not scheduler_output.grammar_req_ids:
        return
    position = {req_id: i for i, req_id in enumerate(req_ids)}
    pairs = [(position[rid], k) for k, rid in enumerate(scheduler_output.grammar_req_ids)
             if rid in position]
    if not pairs:
        return
    words = np.frombuffer(scheduler_output.grammar_bitmask, dtype=np.int32).reshape(
        len(scheduler_output.grammar_req_ids), -1)
    chosen = words[[k for _, k in pairs]]
    forbidden = (forbidden_tokens(chosen, logits.shape[1]) if logits.device.type == "cpu"
                 else forbidden_on_device(to_device(chosen, logits.device), logits.shape[1]))
    rows = [row for row, _ in pairs]
    if rows == list(range(rows[0], rows[0] + len(rows))):  # contiguous: a view, in place
        logits[rows[0]:rows[0] + len(rows)].masked_fill_(forbidden, float("-inf"))
        return
    index = to_device(np.array(rows, dtype=np.int64), logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


def forbidden_tokens(words: np.ndarray, vocab_size: int) -> torch.Tensor:
    """int32 [C, W] -> bool [C, vocab_size], True where the grammar forbids the token: bit
    t % 32 of word t // 32 is 0. Tokens past the mask's width are forbidden."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1,
                         bitorder="little")  # [C, 32 * W], little-endian words
    forbidden = np.ones((words.shape[0], vocab_size), dtype=np.bool_)
    width = min(vocab_size, bits.shape[1])
    np.equal(bits[:, :width], 0, out=forbidden[:, :width])
    return torch.from_numpy(forbidden)


def forbidden_on_device(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`forbidden_tokens` with torch's ops, where the words are (a GPU: the mask is made
    there from the packed words, an eighth of the bytes to copy)."""
    tokens = torch.arange(vocab_size, device=words.device)
    word = (tokens // 32).clamp_(max=words.shape[1] - 1)
    bits = (words[:, word] >> (tokens % 32).to(words.dtype)) & 1
    return (bits == 0) | (tokens >= 32 * words.shape[1])
