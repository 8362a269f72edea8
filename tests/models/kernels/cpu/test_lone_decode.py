"""The lone decode in one C call (lone_decode.c, through lone_decode.py) against the
model's torch forward: the same hidden states to float32 rounding, over consecutive and
scattered cache blocks and contexts across block boundaries; the same greedy tokens and
logprobs through the worker; the families whose config has the call's shape; and the
torch forward wherever the call does not apply."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import gguf
import numpy as np
import pytest
import torch

from gateway.messages import CachedRequestData, NewRequestData, SchedulerOutput
from gateway.models.info.gguf_file import GGUFFile
from gateway.models.info.paths import read_model_info
from gateway.models.kernels.cpu.lone_decode import MAX_CONTEXT, LoneDecode
from gateway.models.layers.attention import AttentionMetadata, gather_index, write_index
from gateway.models.layers.cpu_linear import PackedLinear, can_pack
from gateway.models.loading.loader import load_model
from gateway.models.loading.quantized import weight_bytes
from gateway.platforms.cpu_isa import cpu_isa
from gateway.sampling_params import SamplingParams
from gateway.worker.worker import Worker
from tests.models.test_quantized import _worker
from tests.models.tiny_gguf import write_tiny_gguf
from tests.step_driver import StepDriver
from tests.tiny_model import build_tiny_decoder, build_tiny_llama

# the CPU's instruction set decides the paths; exact products (8-bit activations: test_quant_int8)
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("exact_float32_products")]

Q = gguf.GGMLQuantizationType
BLOCK_SIZE = 16
NUM_BLOCKS = 8
# Relative to the largest hidden value: only the order of a few sums differs (norms,
# softmax), and the residual stream carries those roundings through the layers.
TOLERANCE = 1e-5


def _tiny_gguf(tmp_path: Path, qtype: Q = Q.Q4_1, **config: object) -> Path:
    folder = build_tiny_llama(tmp_path / "tiny", **config)
    return write_tiny_gguf(folder, tmp_path / "tiny.gguf", qtype)


def _meta(block_ids: np.ndarray, length: int, num_kv_heads: int) -> AttentionMetadata:
    """What the runner gives a lone decode at position length - 1 over `block_ids`."""
    position = length - 1
    slot = block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
    num_blocks = -(-length // BLOCK_SIZE)
    used = block_ids[:num_blocks]
    return AttentionMetadata(
        write_index=torch.from_numpy(write_index(np.array([slot]), num_kv_heads,
                                                 NUM_BLOCKS * BLOCK_SIZE)),
        block_size=BLOCK_SIZE, num_decode_tokens=1, decode_batch=1,
        decode_context_len=length, decode_block_ids=used,
        decode_gather_index=torch.from_numpy(gather_index(used, num_kv_heads, NUM_BLOCKS)))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize(("length", "blocks"), [
    (1, [3]), (16, [0]), (17, [0, 1]), (40, [1, 2, 3]),  # consecutive blocks
    (40, [6, 2, 4]), (100, [7, 0, 5, 1, 3, 2, 6])])  # scattered
def test_the_one_call_gives_the_torch_forward_hidden_states(tmp_path, qtype: Q, length: int,
                                                            blocks: list[int]) -> None:
    info = read_model_info(str(_tiny_gguf(tmp_path, qtype)))
    model = load_model(info, torch.device("cpu"), torch.float32)
    lone = LoneDecode.build(model, torch.device("cpu"), torch.float32)
    assert lone is not None
    layers, num_kv_heads, head_dim = model.kv_cache_spec
    generator = torch.Generator().manual_seed(length)
    caches = torch.randn(layers, 2, num_kv_heads, NUM_BLOCKS * BLOCK_SIZE, head_dim,
                         generator=generator)
    ours, theirs = list(caches.clone().unbind(0)), list(caches.clone().unbind(0))
    meta = _meta(np.array(blocks, dtype=np.int64), length, num_kv_heads)
    input_ids, positions = torch.tensor([7]), torch.tensor([length - 1])
    assert lone.applies(input_ids, meta)
    with torch.inference_mode():
        expected = model(input_ids, positions, theirs, meta)
        got, logits = lone(input_ids, positions, ours, meta)
        expected_logits = model.compute_logits(expected)
    assert got.shape == expected.shape == (1, model.config.hidden_size)
    assert (got - expected).abs().max() <= TOLERANCE * expected.abs().max()
    # The output layer (tied to the Q8_0 or quantized embedding) ran in the call too.
    assert logits is not None and logits.shape == expected_logits.shape
    assert (logits - expected_logits).abs().max() <= TOLERANCE * expected_logits.abs().max()
    # This token's K and V went where the torch forward wrote them, and nowhere else.
    for mine, reference in zip(ours, theirs, strict=True):
        assert (mine - reference).abs().max() <= TOLERANCE * reference.abs().max()


def _rows_meta(block_ids: np.ndarray, length: int, num_rows: int,
               num_kv_heads: int) -> AttentionMetadata:
    """What the runner gives a step verifying drafts of one sequence: its last `num_rows`
    tokens up to position length - 1, each a decode query over the blocks up to it."""
    positions = np.arange(length - num_rows, length)
    slots = block_ids[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    num_blocks = -(-length // BLOCK_SIZE)
    table = np.tile(block_ids[:num_blocks], (num_rows, 1))
    visible = np.arange(num_blocks * BLOCK_SIZE)[None, :] <= positions[:, None]
    bias = torch.from_numpy(np.where(visible, np.float32(0.0), np.float32(-np.inf)))
    return AttentionMetadata(
        write_index=torch.from_numpy(write_index(slots, num_kv_heads,
                                                 NUM_BLOCKS * BLOCK_SIZE)),
        block_size=BLOCK_SIZE, num_decode_tokens=num_rows, decode_batch=num_rows,
        decode_context_len=length, decode_block_table=torch.from_numpy(table.astype(np.int32)),
        decode_lens=torch.from_numpy((positions + 1).astype(np.int32)),
        decode_gather_index=torch.from_numpy(gather_index(table, num_kv_heads, NUM_BLOCKS)),
        decode_bias=bias.view(1, num_rows, 1, -1))


def _rows_and_lone_decodes(lone: LoneDecode, caches: torch.Tensor, token_ids: list[int],
                           length: int, blocks: list[int], num_kv_heads: int
                           ) -> tuple[tuple[torch.Tensor, torch.Tensor], list[torch.Tensor],
                                      tuple[torch.Tensor, torch.Tensor], list[torch.Tensor]]:
    """The call over the tokens as one verify step, and as lone decodes one after another:
    (hidden, logits) and the caches after, of each."""
    block_ids = np.array(blocks, dtype=np.int64)
    num_rows = len(token_ids)
    input_ids = torch.tensor(token_ids)
    positions = torch.arange(length - num_rows, length)
    rows_caches, lone_caches = list(caches.clone().unbind(0)), list(caches.clone().unbind(0))
    meta = _rows_meta(block_ids, length, num_rows, num_kv_heads)
    assert lone.applies(input_ids, meta, one_sequence=True)
    assert not lone.applies(input_ids, meta)  # the runner says when the rows are one sequence
    with torch.inference_mode():
        hidden, logits = lone(input_ids, positions, rows_caches, meta)
        lone_steps = [lone(input_ids[r:r + 1], positions[r:r + 1], lone_caches,
                           _meta(block_ids, length - num_rows + r + 1, num_kv_heads))
                      for r in range(num_rows)]
    assert logits is not None and all(step[1] is not None for step in lone_steps)
    return ((hidden, logits), rows_caches,
            (torch.cat([step[0] for step in lone_steps]),
             torch.cat([cast(torch.Tensor, step[1]) for step in lone_steps])), lone_caches)


@pytest.mark.parametrize("weights", ["q4_0", "q4_1", "q8_0", "q4_k_m", "float32"])
@pytest.mark.parametrize(("num_rows", "length", "blocks"), [
    (2, 17, [0, 1]), (5, 40, [6, 2, 4]), (6, 100, [7, 0, 5, 1, 3, 2, 6]), (16, 16, [3])])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_verify_step_in_one_call_equals_lone_decodes_bit_for_bit(
        tmp_path, weights: str, num_rows: int, length: int, blocks: list[int],
        threads: int) -> None:
    """Speculative decoding's verify step (the last token and its drafts, one sequence) in
    the one call: each row's hidden state and logits, and the KV written, are exactly those
    of lone decodes of the same tokens one after another, for weights kept quantized (4
    rows at a time share a weight row's unpacking, 5 and 6 run 4 + the rest) and dense
    float32 ones; so greedy speculation gives what decoding without it gives."""
    if weights == "float32":
        path = build_tiny_llama(tmp_path / "tiny", hidden_size=48, head_dim=12)
    elif weights == "q4_k_m":
        folder = build_tiny_llama(tmp_path / "tiny", hidden_size=256, intermediate_size=512,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=False)
        path = write_tiny_gguf(folder, tmp_path / "tiny.gguf", qtype_of=_q4_k_m)
    else:
        path = _tiny_gguf(tmp_path, getattr(Q, weights.upper()))
    model = load_model(read_model_info(str(path)), torch.device("cpu"), torch.float32)
    lone = LoneDecode.build(model, torch.device("cpu"), torch.float32)
    assert lone is not None
    lone.threads = threads
    layers, num_kv_heads, head_dim = model.kv_cache_spec
    caches = torch.randn(layers, 2, num_kv_heads, NUM_BLOCKS * BLOCK_SIZE, head_dim,
                         generator=torch.Generator().manual_seed(num_rows))
    token_ids = [(7 * r + 3) % 100 for r in range(num_rows)]
    (hidden, logits), rows_caches, (lone_hidden, lone_logits), lone_caches = \
        _rows_and_lone_decodes(lone, caches, token_ids, length, blocks, num_kv_heads)
    assert hidden.shape == (num_rows, model.config.hidden_size)
    assert torch.equal(hidden, lone_hidden) and torch.equal(logits, lone_logits)
    for mine, reference in zip(rows_caches, lone_caches, strict=True):
        assert torch.equal(mine, reference)
    # And the rows are the torch forward's, which runs them as decode queries too.
    theirs = list(caches.clone().unbind(0))
    meta = _rows_meta(np.array(blocks, dtype=np.int64), length, num_rows, num_kv_heads)
    with torch.inference_mode():
        expected = model(torch.tensor(token_ids), torch.arange(length - num_rows, length),
                         theirs, meta)
    assert (hidden - expected).abs().max() <= TOLERANCE * expected.abs().max()


@pytest.mark.parametrize("num_rows", [2, 6, 9])
def test_a_bfloat16_verify_step_in_one_call(tmp_path, num_rows: int) -> None:
    """bfloat16 weights: on an AVX512-BF16 CPU several rows take the products of bfloat16
    pairs (activations rounded to bfloat16, as the torch forward rounds them; 9 rows: a pass
    of 6 and one of 3), so rows are held to the float32 model within the bfloat16
    tolerance, as a lone decode is; elsewhere the loader keeps no copy the call reads."""
    info = read_model_info(str(build_tiny_llama(tmp_path / "tiny")))
    cpu = torch.device("cpu")
    model = load_model(info, cpu, torch.bfloat16)
    lone = LoneDecode.build(model, cpu, torch.bfloat16)
    assert (lone is not None) == can_pack(cpu, torch.bfloat16)
    if lone is None:
        return
    lone.threads = 2
    exact = load_model(info, cpu, torch.float32)
    layers, num_kv_heads, head_dim = model.kv_cache_spec
    caches = torch.randn(layers, 2, num_kv_heads, NUM_BLOCKS * BLOCK_SIZE, head_dim,
                         generator=torch.Generator().manual_seed(num_rows)).to(torch.bfloat16)
    blocks, length = [6, 2, 4, 1], 50
    token_ids = [(5 * r + 1) % 100 for r in range(num_rows)]
    (hidden, logits), _, (lone_hidden, lone_logits), _ = _rows_and_lone_decodes(
        lone, caches, token_ids, length, blocks, num_kv_heads)
    meta = _rows_meta(np.array(blocks, dtype=np.int64), length, num_rows, num_kv_heads)
    with torch.inference_mode():
        expected = exact(torch.tensor(token_ids), torch.arange(length - num_rows, length),
                         list(caches.float().unbind(0)), meta)
        expected_logits = exact.compute_logits(expected)
    for got, got_logits in ((hidden, logits), (lone_hidden, lone_logits)):
        assert (got.float() - expected).abs().max() <= BF16_TOLERANCE * expected.abs().max()
        assert (got_logits - expected_logits).abs().max() <= (
            BF16_TOLERANCE * expected_logits.abs().max())


def _q4_k_m(name: str) -> Q:
    """llama.cpp's Q4_K_M mix, simplified: attn_v, ffn_down and the output layer Q6_K, the
    rest Q4_K (the embedding too); layer 1's attn_v Q8_0 (llama.cpp's fallback for a Q6_K
    whose rows are not whole super-blocks)."""
    if name == "blk.1.attn_v.weight":
        return Q.Q8_0
    return Q.Q6_K if ("attn_v" in name or "ffn_down" in name or name == "output.weight") \
        else Q.Q4_K


def test_a_q4_k_m_model_keeps_its_blocks_and_answers_as_its_dequantized_weights(
        tmp_path) -> None:
    """A Q4_K_M-like file (widths of whole 256-column super-blocks) stays in its blocks,
    holding no more bytes than the file's tensors; its hidden states and logits, in the one
    call and in the torch forward, are within float32 rounding of the dequantized model's."""
    folder = build_tiny_llama(tmp_path / "tiny", hidden_size=256, intermediate_size=512,
                              num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=False)
    path = write_tiny_gguf(folder, tmp_path / "tiny.gguf", qtype_of=_q4_k_m)
    info = read_model_info(str(path))
    cpu = torch.device("cpu")
    model = load_model(info, cpu, torch.float32)
    dense = load_model(info, cpu, torch.float32, quantization="none")
    file_bytes = sum(tensor.num_bytes for tensor in GGUFFile(path).tensors.values())
    assert weight_bytes(model) <= 1.2 * file_bytes < weight_bytes(dense) / 5
    types = [layer.self_attn.qkv_proj.weight_q.types for layer in model.model.layers]
    assert types == [("Q4_K", "Q6_K"), ("Q4_K", "Q8_0")]
    lone = LoneDecode.build(model, cpu, torch.float32)
    assert lone is not None and {m.bits for layer in lone.matrices for m in layer} == {1}
    assert lone.head is not None and lone.head.bits == 1
    layers, num_kv_heads, head_dim = model.kv_cache_spec
    caches = torch.randn(layers, 2, num_kv_heads, NUM_BLOCKS * BLOCK_SIZE, head_dim,
                         generator=torch.Generator().manual_seed(0))
    ours, theirs, reference = (list(caches.clone().unbind(0)) for _ in range(3))
    meta = _meta(np.array([6, 2, 4], dtype=np.int64), 40, num_kv_heads)
    input_ids, positions = torch.tensor([9]), torch.tensor([39])
    with torch.inference_mode():
        got, logits = lone(input_ids, positions, ours, meta)
        forward = model(input_ids, positions, theirs, meta)
        expected = dense(input_ids, positions, reference, meta)
        expected_logits = dense.compute_logits(expected)
        forward_logits = model.compute_logits(forward)
    for hidden in (got, forward):
        assert (hidden - expected).abs().max() <= TOLERANCE * expected.abs().max()
    assert logits is not None
    for computed in (logits, forward_logits):
        assert (computed - expected_logits).abs().max() <= (
            TOLERANCE * expected_logits.abs().max())


@pytest.mark.parametrize(("length", "blocks", "hidden", "layouts"), [
    (1, [3], 64, {1}), (40, [6, 2, 4], 64, {1}),
    # hidden 48: o and down (48 outputs) stay transposed, qkv (96) and gate_up (256) blocked
    (40, [6, 2, 4], 48, {0, 1})])
@pytest.mark.parametrize("threads", [2, 3])
def test_the_one_call_runs_float32_weights_as_the_torch_forward_does(
        tmp_path, length: int, blocks: list[int], hidden: int, layouts: set[int],
        threads: int) -> None:
    """Dense float32 projections (--quantization none, or an HF folder) in the one call:
    their weights as the single-row products keep them, in blocks of 32 outputs where
    their outputs are a multiple of 32, else transposed."""
    info = read_model_info(str(build_tiny_llama(tmp_path / "tiny", hidden_size=hidden,
                                                head_dim=12 if hidden == 48 else 16)))
    model = load_model(info, torch.device("cpu"), torch.float32)
    lone = LoneDecode.build(model, torch.device("cpu"), torch.float32)
    assert lone is not None
    assert {matrix.bits for layer in lone.matrices for matrix in layer} == {32}
    assert {matrix.blocked for layer in lone.matrices for matrix in layer} == layouts
    assert lone.head is not None and lone.head.blocked == int(lone.head.rows % 32 == 0)
    lone.threads = threads  # columns, or blocks, split between threads
    layers, num_kv_heads, head_dim = model.kv_cache_spec
    caches = torch.randn(layers, 2, num_kv_heads, NUM_BLOCKS * BLOCK_SIZE, head_dim,
                         generator=torch.Generator().manual_seed(length))
    ours, theirs = list(caches.clone().unbind(0)), list(caches.clone().unbind(0))
    meta = _meta(np.array(blocks, dtype=np.int64), length, num_kv_heads)
    input_ids, positions = torch.tensor([5]), torch.tensor([length - 1])
    with torch.inference_mode():
        expected = model(input_ids, positions, theirs, meta)
        got, logits = lone(input_ids, positions, ours, meta)
        expected_logits = model.compute_logits(expected)
    assert (got - expected).abs().max() <= TOLERANCE * expected.abs().max()
    assert logits is not None
    assert (logits - expected_logits).abs().max() <= TOLERANCE * expected_logits.abs().max()
    for mine, reference in zip(ours, theirs, strict=True):
        assert (mine - reference).abs().max() <= TOLERANCE * reference.abs().max()


# bfloat16: the call reads bfloat16 weights and cache and keeps float32 between its
# products, where the float32 model's weights are exact and the bfloat16 torch forward
# rounds every op to bfloat16 (8 bits of mantissa): relative to the largest value.
BF16_TOLERANCE = 0.03


@pytest.mark.parametrize(("length", "blocks"), [
    (1, [3]), (40, [6, 2, 4]), (100, [7, 0, 5, 1, 3, 2, 6])])
def test_a_bfloat16_model_decodes_alone_as_float32_does(tmp_path, length: int,
                                                       blocks: list[int]) -> None:
    """bfloat16 weights and a bfloat16 KV cache against the same model in float32, on the
    path the product takes on this CPU: where oneDNN packs bfloat16 (AVX-512), the one call
    (transposed copies, float32 inside), also against the bfloat16 torch forward; elsewhere
    (AVX2) the loader keeps plain layers, the call does not apply, and the step is the
    bfloat16 torch forward."""
    info = read_model_info(str(build_tiny_llama(tmp_path / "tiny")))
    cpu = torch.device("cpu")
    model = load_model(info, cpu, torch.bfloat16)
    native = can_pack(cpu, torch.bfloat16)
    assert native == cpu_isa().has_onednn_bf16  # the path follows the shared ISA check
    lone = LoneDecode.build(model, cpu, torch.bfloat16)
    assert (lone is not None) == native
    if lone is None:
        assert not any(isinstance(module, PackedLinear) for module in model.modules())
    else:
        assert {matrix.bits for layer in lone.matrices for matrix in layer} == {16}
        assert {matrix.blocked for layer in lone.matrices for matrix in layer} == {1}
        lone.threads = 2
    exact = load_model(info, cpu, torch.float32)
    layers, num_kv_heads, head_dim = model.kv_cache_spec
    caches = torch.randn(layers, 2, num_kv_heads, NUM_BLOCKS * BLOCK_SIZE, head_dim,
                         generator=torch.Generator().manual_seed(length)).to(torch.bfloat16)
    ours, f32_caches = list(caches.clone().unbind(0)), list(caches.float().unbind(0))
    meta = _meta(np.array(blocks, dtype=np.int64), length, num_kv_heads)
    input_ids, positions = torch.tensor([5]), torch.tensor([length - 1])
    with torch.inference_mode():
        if lone is None:
            got = model(input_ids, positions, ours, meta)
            logits: torch.Tensor | None = model.compute_logits(got).float()
        else:
            got, logits = lone(input_ids, positions, ours, meta)
        hidden = exact(input_ids, positions, f32_caches, meta)
        exact_logits = exact.compute_logits(hidden)
    assert got.dtype == torch.bfloat16 and got.shape == hidden.shape
    assert (got.float() - hidden).abs().max() <= BF16_TOLERANCE * hidden.abs().max()
    assert logits is not None and logits.dtype == torch.float32
    spread = exact_logits.abs().max()
    assert (logits - exact_logits).abs().max() <= BF16_TOLERANCE * spread
    # This token's K and V went where the float32 model wrote them, rounded to bfloat16,
    # and nowhere else: every other slot is bit for bit unchanged.
    for mine, reference, before in zip(ours, f32_caches, caches.unbind(0), strict=True):
        changed = mine != before
        assert (changed <= (reference.to(torch.bfloat16) != before)).all()
        assert (mine.float() - reference).abs().max() <= (
            BF16_TOLERANCE * reference.abs().max())
    if lone is not None:  # the bfloat16 torch forward: no closer to float32 than the call is
        theirs = list(caches.clone().unbind(0))
        with torch.inference_mode():
            torch_logits = model.compute_logits(model(input_ids, positions, theirs, meta))
        assert (logits - exact_logits).abs().max() <= (
            1.5 * (torch_logits.float() - exact_logits).abs().max())


def test_quantized_weights_with_bfloat16_activations(tmp_path) -> None:
    """--dtype bfloat16 on a GGUF whose weights stay quantized: the products are the
    float32 kernels' either way, the cache and the embedding bfloat16."""
    info = read_model_info(str(_tiny_gguf(tmp_path)))
    cpu = torch.device("cpu")
    model = load_model(info, cpu, torch.bfloat16)
    lone = LoneDecode.build(model, cpu, torch.bfloat16)
    assert lone is not None and {m.bits for layer in lone.matrices for m in layer} == {4}
    exact = load_model(info, cpu, torch.float32)
    layers, num_kv_heads, head_dim = model.kv_cache_spec
    caches = torch.randn(layers, 2, num_kv_heads, NUM_BLOCKS * BLOCK_SIZE, head_dim,
                         generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    meta = _meta(np.array([6, 2, 4], dtype=np.int64), 40, num_kv_heads)
    args = (torch.tensor([5]), torch.tensor([39]))
    with torch.inference_mode():
        got, logits = lone(*args, list(caches.clone().unbind(0)), meta)
        hidden = exact(*args, list(caches.float().unbind(0)), meta)
        exact_logits = exact.compute_logits(hidden)
    assert got.dtype == torch.bfloat16
    assert (got.float() - hidden).abs().max() <= BF16_TOLERANCE * hidden.abs().max()
    assert logits is not None
    assert (logits - exact_logits).abs().max() <= BF16_TOLERANCE * exact_logits.abs().max()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_head_dims_off_the_vector_width_and_single_kv_heads(tmp_path, threads: int) -> None:
    """Any number of threads (3: more than CI's cores, and more than the KV heads)."""
    info = read_model_info(str(_tiny_gguf(tmp_path, hidden_size=96, num_attention_heads=8,
                                          num_key_value_heads=1, head_dim=12)))
    model = load_model(info, torch.device("cpu"), torch.float32)
    lone = LoneDecode.build(model, torch.device("cpu"), torch.float32)
    assert lone is not None
    lone.threads = threads
    layers, num_kv_heads, head_dim = model.kv_cache_spec
    assert (num_kv_heads, head_dim) == (1, 12)
    caches = torch.randn(layers, 2, num_kv_heads, NUM_BLOCKS * BLOCK_SIZE, head_dim)
    meta = _meta(np.array([4, 1, 6], dtype=np.int64), 35, num_kv_heads)
    args = (torch.tensor([3]), torch.tensor([34]))
    with torch.inference_mode():
        expected = model(*args, list(caches.clone().unbind(0)), meta)
        got, _ = lone(*args, list(caches.clone().unbind(0)), meta)
    assert (got - expected).abs().max() <= TOLERANCE * expected.abs().max()


def test_where_the_one_call_does_not_apply(tmp_path, monkeypatch) -> None:
    info = read_model_info(str(_tiny_gguf(tmp_path)))
    cpu = torch.device("cpu")
    monkeypatch.setenv("GATEWAY_CPU_SINGLE_ROW_WEIGHTS", "0")
    dense = load_model(info, cpu, torch.float32, quantization="none")
    assert LoneDecode.build(dense, cpu, torch.float32) is None  # no transposed weights
    monkeypatch.delenv("GATEWAY_CPU_SINGLE_ROW_WEIGHTS")
    kept = load_model(info, cpu, torch.float32)
    assert LoneDecode.build(kept, cpu, torch.float16) is None  # float32 and bfloat16 only
    lone = LoneDecode.build(kept, cpu, torch.float32)
    assert lone is not None
    meta = _meta(np.arange(NUM_BLOCKS, dtype=np.int64), 20, 2)
    assert not lone.applies(torch.tensor([1, 2]), meta)  # more than one token
    meta.decode_context_len = MAX_CONTEXT + 1
    assert not lone.applies(torch.tensor([1]), meta)  # a longer context than it sizes for
    monkeypatch.setenv("GATEWAY_CPU_LONE_DECODE", "0")
    assert LoneDecode.build(kept, cpu, torch.float32) is None


def _greedy_with_logprobs(path: Path) -> tuple[dict[str, list[int]],
                                               dict[str, list[float]], int]:
    worker = _worker(model=path, kv_cache_gib=0.01)
    runner = worker.model_runner
    assert runner is not None
    forwards: list[int] = []  # the steps that ran the torch forward
    runner.model.register_forward_pre_hook(  # type: ignore[attr-defined]
        lambda *_: forwards.append(1))
    driver = StepDriver(worker, runner.num_blocks)
    params = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=1)
    # Two sequences side by side, then the first alone across block boundaries: its blocks
    # are then not consecutive (the second's lie between them).
    first = driver.add("a", list(range(3, 13)), params)
    second = driver.add("b", list(range(20, 40)), params)
    logprobs: dict[str, list[float]] = {"a": [], "b": []}
    steps = 0
    while len(first.output) < 60:
        output = driver.step()
        steps += 1
        for req_id, entry in output.logprobs.items():
            logprobs[req_id].append(entry.logprobs[0])
        if len(second.output) == 12 and second in driver.running:
            driver.finish("b")
    return {"a": first.output, "b": second.output}, logprobs, steps - len(forwards)


@pytest.mark.parametrize("weights", ["q4_1", "float32"])
def test_the_worker_answers_as_the_torch_forward_does(tmp_path, monkeypatch,
                                                      weights: str) -> None:
    path = _tiny_gguf(tmp_path) if weights == "q4_1" else build_tiny_llama(tmp_path / "hf")
    tokens, logprobs, lone_steps = _greedy_with_logprobs(path)
    monkeypatch.setenv("GATEWAY_CPU_LONE_DECODE", "0")
    torch_tokens, torch_logprobs, none = _greedy_with_logprobs(path)
    assert lone_steps == 60 - 12 and none == 0  # a's tokens after b finished
    assert tokens == torch_tokens and [len(t) for t in tokens.values()] == [60, 12]
    for req_id in tokens:
        assert np.allclose(logprobs[req_id], torch_logprobs[req_id], atol=1e-5)


def _verify_steps(worker: Worker, prompt: list[int], plain: list[int], num_drafts: int
                  ) -> tuple[list[int], int]:
    """Greedy decoding of `prompt` through steps that verify drafts taken from `plain` (every
    third step's last draft made wrong): the tokens, and the steps the torch forward ran."""
    forwards: list[int] = []
    runner = worker.model_runner
    assert runner is not None
    runner.model.register_forward_pre_hook(  # type: ignore[attr-defined]
        lambda *_: forwards.append(1))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1000)
    output = worker.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(
            req_id="r", prompt_token_ids=prompt, sampling_params=params,
            block_ids=list(range(runner.num_blocks)), num_computed_tokens=0)],
        scheduled_cached_reqs=[], num_scheduled_tokens={"r": len(prompt)},
        finished_req_ids=[]))
    tokens, computed, step = list(output.sampled_token_ids), len(prompt), 0
    forwards.clear()  # (the prefill)
    while len(tokens) < len(plain) - num_drafts:
        drafts = plain[len(tokens):len(tokens) + num_drafts]
        if step % 3 == 2:
            drafts[-1] = (drafts[-1] + 1) % 100
        output = worker.execute_model(SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=[CachedRequestData(
                req_id="r", new_block_ids=[], num_computed_tokens=computed)],
            num_scheduled_tokens={"r": 1 + num_drafts}, finished_req_ids=[],
            scheduled_spec_decode_tokens={"r": drafts}))
        new = [*output.sampled_token_ids, *output.more_token_ids.get("r", [])]
        tokens += new
        computed += len(new)
        step += 1
    return tokens, len(forwards)


@pytest.mark.parametrize("weights", ["q4_1", "float32"])
def test_greedy_verify_steps_in_the_one_call_keep_the_tokens_of_lone_decodes(
        tmp_path, weights: str) -> None:
    """Through the worker: a lone sequence's verify steps run the one call (never the
    torch forward), and the tokens they accept are those that decoding without drafts
    gives, draft after draft (each row is bit for bit a lone decode's)."""
    path = _tiny_gguf(tmp_path) if weights == "q4_1" else build_tiny_llama(tmp_path / "hf")
    prompt = list(range(3, 13))
    worker = _worker(model=path, kv_cache_gib=0.01)
    assert worker.model_runner is not None
    driver = StepDriver(worker, worker.model_runner.num_blocks)
    request = driver.add("plain", prompt, SamplingParams(temperature=0.0, ignore_eos=True))
    while len(request.output) < 40:
        driver.step()
    tokens, forwards = _verify_steps(_worker(model=path, kv_cache_gib=0.01), prompt,
                                     request.output, num_drafts=4)
    assert forwards == 0
    assert tokens == request.output[:len(tokens)] and len(tokens) >= 30


# Each decoder family's tiny model -> whether the one call serves it (its config decides).
FAMILY_CASES = {
    "llama": ("LlamaForCausalLM", {}, True),
    "llama-biases": ("LlamaForCausalLM", {"attention_bias": True}, False),
    "mistral-window": ("MistralForCausalLM", {}, True),  # while the context fits in it
    "mistral": ("MistralForCausalLM", {"sliding_window": None}, True),
    "qwen2": ("Qwen2ForCausalLM", {}, False),  # q/k/v biases
    "qwen3": ("Qwen3ForCausalLM", {}, False),  # q/k norms
    "gemma3": ("Gemma3ForCausalLM", {}, False),  # offset norms, scales, GELU, soft-capping
    "phi3-partial-rotary": ("Phi3ForCausalLM", {}, False),
    "phi3": ("Phi3ForCausalLM", {"partial_rotary_factor": 1.0}, True),
}


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_the_config_decides_which_families_the_one_call_serves(tmp_path, case: str) -> None:
    """Every family whose config has the shape the call computes gets it, with the torch
    forward's hidden states and logits; the others run the torch forward. A sliding window
    limits the contexts it takes to those the window hides nothing of."""
    architecture, config, serves = FAMILY_CASES[case]
    if architecture == "LlamaForCausalLM":
        folder = build_tiny_llama(tmp_path / case, **config)
    else:
        folder = build_tiny_decoder(tmp_path / case, architecture, **config)
    cpu = torch.device("cpu")
    model = load_model(read_model_info(str(folder)), cpu, torch.float32)
    lone = LoneDecode.build(model, cpu, torch.float32)
    assert (lone is not None) == serves == LoneDecode.may_run(model, cpu, torch.float32)
    if lone is None:
        return
    window = min((w for w in model.config.layer_windows if w), default=None)
    length = 8 if window else 40
    assert lone.max_context == (window or MAX_CONTEXT)
    layers, num_kv_heads, head_dim = model.kv_cache_spec
    caches = torch.randn(layers, 2, num_kv_heads, NUM_BLOCKS * BLOCK_SIZE, head_dim,
                         generator=torch.Generator().manual_seed(4))
    ours, theirs = list(caches.clone().unbind(0)), list(caches.clone().unbind(0))
    meta = _meta(np.array([6, 2, 4], dtype=np.int64), length, num_kv_heads)
    input_ids, positions = torch.tensor([5]), torch.tensor([length - 1])
    assert lone.applies(input_ids, meta)
    with torch.inference_mode():
        expected = model(input_ids, positions, theirs, meta)
        got, logits = lone(input_ids, positions, ours, meta)
        expected_logits = model.compute_logits(expected)
    assert (got - expected).abs().max() <= TOLERANCE * expected.abs().max()
    assert logits is not None
    assert (logits - expected_logits).abs().max() <= TOLERANCE * expected_logits.abs().max()
    if window:  # one key more than the window: the torch forward's windowed attention
        assert not lone.applies(input_ids, _meta(np.array([6, 2, 4], dtype=np.int64),
                                                 window + 1, num_kv_heads))
