"""The Triton KV-cache store writes each token's K and V heads at its slot, as its torch
reference does, and padded tokens (negative slots) nowhere."""

from __future__ import annotations

import pytest
import torch

from gateway.models.kernels.triton.kv_store import store_kv
from gateway.models.kernels.triton.reference import store_kv_reference
from tests.models.triton.batches import DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_writes_each_token_at_its_slot(dtype: torch.dtype,
                                             slot_dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, head_dim, num_slots = 4, 2, 64, 48
    qkv = torch.randn(6, (num_heads + 2 * num_kv_heads) * head_dim).to(DEVICE, dtype)
    kv = qkv[:, num_heads * head_dim:].view(6, 2 * num_kv_heads, head_dim)  # strided rows
    slots = torch.tensor([5, -1, 17, 47, -1, 16], dtype=slot_dtype, device=DEVICE)
    cache = torch.zeros(2, num_kv_heads, num_slots, head_dim, dtype=dtype, device=DEVICE)
    expected = cache.clone()
    store_kv(kv, cache, slots)
    store_kv_reference(kv, expected, slots)
    assert torch.equal(cache, expected)
    assert torch.equal(cache[1, 1, 47], kv[3, 3])  # token 3's second V head
    written = torch.zeros(num_slots, dtype=torch.bool, device=DEVICE)
    written[[5, 17, 47, 16]] = True
    assert bool((cache[:, :, ~written] == 0).all())  # padded tokens wrote nothing


def test_store_of_only_padding_writes_nothing() -> None:
    cache = torch.zeros(2, 1, 16, 16, device=DEVICE)
    store_kv(torch.ones(3, 2, 16, device=DEVICE), cache, torch.full((3,), -1, device=DEVICE))
    assert bool((cache == 0).all())


def test_store_names_a_slot_count_that_does_not_match() -> None:
    with pytest.raises(ValueError, match="2 slots for 3 tokens"):
        store_kv(torch.ones(3, 2, 16), torch.zeros(2, 1, 16, 16), torch.zeros(2))
