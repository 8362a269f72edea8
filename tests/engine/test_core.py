"""The engine core's start-up line about its KV cache (vLLM's wording)."""

from __future__ import annotations

import pytest

from gateway.engine.core import kv_capacity_line


@pytest.mark.parametrize(("device", "blocks", "block_size", "model_len", "line"), [
    ("cuda", 134_688, 16, 131_072, "GPU KV cache size: 2,155,008 tokens, Maximum concurrency "
     "for 131,072 tokens per request: 16.44x"),
    ("cpu", 4096, 16, 2048, "CPU KV cache size: 65,536 tokens, Maximum concurrency for 2,048 "
     "tokens per request: 32.00x"),
    # A request of 100 tokens holds 7 whole blocks of 16: 10 blocks hold 1 of them and part
    # of another.
    ("cpu", 10, 16, 100, "CPU KV cache size: 160 tokens, Maximum concurrency for 100 tokens "
     "per request: 1.43x"),
    ("cuda", 8, 16, 8192, "GPU KV cache size: 128 tokens, Maximum concurrency for 8,192 "
     "tokens per request: 0.02x"),
])
def test_the_kv_capacity_line_gives_tokens_and_concurrency(device, blocks, block_size,
                                                          model_len, line):
    assert kv_capacity_line(device, blocks, block_size, model_len) == line
