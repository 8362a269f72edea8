"""The Triton backend's per-step metadata, built by plain functions (query start locations,
sequence lengths, block table, slot mapping; padded for CUDA graphs), and the choice of
attention backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gateway.models.layers.triton_attention import (
    build_triton_metadata,
    graph_batch_size,
    use_triton_attention,
)

BLOCKS = np.array([[7, 2, 0, 0], [4, 0, 0, 0], [9, 0, 0, 0], [1, 3, 8, 5]])


def _step(**padding: int):  # type: ignore[no-untyped-def]
    # Two decodes (20 and 15 tokens cached), a fresh 5-token prompt, 20 tokens after 16.
    return build_triton_metadata(np.array([1, 1, 5, 20]), np.array([20, 15, 0, 16]),
                                 BLOCKS, 16, **padding)


def test_metadata_of_a_mixed_step() -> None:
    meta = _step()
    assert meta.query_start_loc.tolist() == [0, 1, 2, 7, 27]
    assert meta.seq_lens.tolist() == [21, 16, 5, 36]
    assert meta.block_table.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.block_table.tolist() == BLOCKS[:, :3].tolist()  # 36 tokens: 3 blocks
    assert (meta.num_decode_seqs, meta.max_query_len, meta.max_seq_len) == (2, 20, 36)
    slots = meta.slot_mapping.tolist()
    assert slots[0] == 2 * 16 + 4  # position 20: block 1 of sequence 0 (cache block 2)
    assert slots[1] == 4 * 16 + 15
    assert slots[2:7] == [9 * 16 + i for i in range(5)]
    assert slots[7:] == ([3 * 16 + i for i in range(16)]  # positions 16-31: block 1
                         + [8 * 16 + i for i in range(4)])  # 32-35: block 2


def test_padding_adds_empty_sequences_and_slotless_tokens() -> None:
    meta = _step(num_seqs_padded=8, num_tokens_padded=32, num_block_columns=4)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 7, 27, 27, 27, 27, 27]
    assert meta.seq_lens.tolist() == [21, 16, 5, 36, 0, 0, 0, 0]
    assert meta.block_table.shape == (8, 4)
    assert bool((meta.block_table[4:] == 0).all())
    assert meta.slot_mapping.tolist()[27:] == [-1] * 5
    assert meta.num_decode_seqs == 2


def test_a_padded_decode_step_is_all_decodes() -> None:
    size = graph_batch_size(3)
    meta = build_triton_metadata(np.array([1, 1, 1]), np.array([3, 10, 15]), BLOCKS[:3], 16,
                                 num_seqs_padded=size, num_tokens_padded=size)
    assert meta.num_decode_seqs == size == 4
    assert meta.slot_mapping.tolist() == [7 * 16 + 3, 4 * 16 + 10, 9 * 16 + 15, -1]
    assert meta.seq_lens.tolist() == [4, 11, 16, 0]


def test_padding_below_the_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="2 sequences and 27 tokens: the batch has 4"):
        _step(num_seqs_padded=2, num_tokens_padded=27)


@pytest.mark.parametrize(("num_seqs", "expected"), [
    (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (256, 256), (257, 272), (512, 512),
    (513, None)])
def test_graph_batch_sizes_are_vllms(num_seqs: int, expected: int | None) -> None:
    assert graph_batch_size(num_seqs) == expected


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("GATEWAY_ATTENTION_BACKEND", raising=False)
    assert not use_triton_attention(cpu)  # auto: the CPU keeps the torch path
    assert use_triton_attention(cuda)  # auto: CUDA, where Triton imports
    assert not use_triton_attention(cuda, "torch")
    monkeypatch.setenv("GATEWAY_ATTENTION_BACKEND", "Triton")
    assert use_triton_attention(cpu)  # forced (the interpreter runs it here)
    with pytest.raises(ValueError, match="'flash' .* is not one of auto, torch, triton"):
        use_triton_attention(cpu, "flash")
