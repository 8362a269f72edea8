"""GGUF Q4_0, Q4_1 and Q8_0 weights kept quantized: the int4 kernel's zero point, exact
codes, torch's int4 kernel's matmuls close to the dequantized weight (the gateway's float32
kernels' are in tests/models/kernels/cpu), embedding rows of both kernels, the tiny and the
default model loading quantized by default, and the default model's greedy tokens equal to
the dequantized model's."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from gateway.config import CacheConfig, EngineConfig, ModelConfig
from gateway.models.info.gguf_file import GGUFFile
from gateway.models.info.paths import default_model_path, read_model_info
from gateway.models.kernels.cpu import library as cpu_kernels
from gateway.models.kernels.cpu.quant_weight import Float32QuantWeight
from gateway.models.layers.gguf_quant import QuantWeight
from gateway.models.layers.quant_linear import Int4Weight, QuantEmbedding, QuantLinear, QuantMatrix
from gateway.models.loading.loader import load_model
from gateway.models.loading.quantized import weight_bytes
from gateway.sampling_params import SamplingParams
from gateway.tokenizer import load_tokenizer
from gateway.worker.worker import Worker
from tests.models.gguf_weights import KEPT, quantized_weight
from tests.models.tiny_gguf import write_tiny_gguf
from tests.step_driver import StepDriver
from tests.tiny_model import build_tiny_llama

# the CPU's instruction set decides the paths; exact products (8-bit activations: test_quant_int8)
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("exact_float32_products")]

Q = gguf.GGMLQuantizationType
# Relative to the output's largest value, a matmul stays within this of the dequantized
# weight's float32 matmul: torch's int4 kernel computes in bfloat16 (activations, scales and
# outputs), the gateway's kernels in float32 (only the order of the sums differs).
MATMUL_TOLERANCE = {"int4": 0.01, "float32": 1e-5}


def _kernel(name: str, weight: QuantWeight) -> QuantMatrix:
    if name == "int4":
        return Int4Weight(weight)
    library = cpu_kernels.load()
    assert library is not None, "the float32 kernels did not build here (see the log)"
    return Float32QuantWeight(weight, library)


def test_the_int4_kernel_reads_code_minus_8_times_scale_plus_zero() -> None:
    codes = torch.randint(0, 16, (64, 64), dtype=torch.int32)
    scale, zero = torch.rand(64, 2) + 0.5, torch.randn(64, 2)  # [N, K / 32]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_zeros = torch.stack((scale.t(), zero.t()), -1).contiguous().bfloat16()
    x = torch.randn(2, 64).bfloat16()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)
    s, z = (t.bfloat16().float().repeat_interleave(32, 1) for t in (scale, zero))
    expected = x.float() @ ((codes - 8) * s + z).t()
    assert (y.float() - expected).abs().max() < 0.02 * expected.abs().max()


@pytest.mark.parametrize("qtype", KEPT)
def test_codes_scales_and_minimums_dequantize_exactly_as_gguf(qtype: Q) -> None:
    weight, expected = quantized_weight(qtype)
    assert weight.bits == (8 if qtype == Q.Q8_0 else 4)
    assert torch.equal(weight.dequantize(), expected)


@pytest.mark.parametrize("qtype", KEPT)
# up to 8 rows the int4 kernel, above a dense matmul
@pytest.mark.parametrize("num_rows", [1, 3, 5, 8, 11, 40, 100])
def test_an_int4_matmul_is_close_to_the_dequantized_weights(qtype: Q, num_rows: int) -> None:
    weight, dequantized = quantized_weight(qtype)
    x = torch.randn(num_rows, 256, dtype=torch.float64).float()
    expected = (x.double() @ dequantized.double().t()).float()
    y = _kernel("int4", weight).matmul(x)
    assert y.dtype == torch.float32 and y.shape == expected.shape
    assert (y - expected).abs().max() < MATMUL_TOLERANCE["int4"] * expected.abs().max()


@pytest.mark.parametrize("kernel", ["float32", "int4"])
@pytest.mark.parametrize("qtype", KEPT)
def test_embedding_rows_are_the_dequantized_rows(kernel: str, qtype: Q) -> None:
    weight, dequantized = quantized_weight(qtype)
    ids = torch.tensor([0, 1, 15, 16, 31, 32, 33, 63, 64, 95])
    rows = QuantEmbedding(_kernel(kernel, weight), torch.float32)(ids)
    tolerance = MATMUL_TOLERANCE[kernel] * dequantized.abs().max()
    assert (rows - dequantized[ids]).abs().max() <= tolerance


def test_columns_off_the_groups_cannot_be_cut() -> None:
    weight, _ = quantized_weight(Q.Q4_1)
    assert weight.narrow(1, 64, 128).shape == (96, 128)
    with pytest.raises(ValueError, match="do not fall on the quantization groups of 32"):
        weight.narrow(1, 16, 64)


@pytest.mark.parametrize("qtype", KEPT)
def test_a_quantized_tiny_gguf_loads_quantized_by_default_and_none_dequantizes(  # type: ignore[no-untyped-def]
        tmp_path, qtype: Q) -> None:
    folder = build_tiny_llama(tmp_path / "tiny")
    info = read_model_info(str(write_tiny_gguf(folder, tmp_path / "tiny.gguf", qtype)))
    kept = load_model(info, torch.device("cpu"), torch.float32)  # the default: gguf
    assert isinstance(kept.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(kept.model.embed_tokens, QuantEmbedding)  # 434 rows: any count fits
    assert isinstance(kept.model.embed_tokens.weight_q, Float32QuantWeight)
    dense = load_model(info, torch.device("cpu"), torch.float32, quantization="none")
    assert not any(isinstance(m, QuantLinear | QuantEmbedding) for m in dense.modules())
    hidden = torch.randn(2, 64)
    expected = dense.compute_logits(hidden)
    error = (kept.compute_logits(hidden) - expected).abs().max()
    assert error < MATMUL_TOLERANCE["float32"] * expected.abs().max()


def test_without_the_float32_kernels_a_gguf_loads_dequantized_by_default(  # type: ignore[no-untyped-def]
        tmp_path, monkeypatch) -> None:
    folder = build_tiny_llama(tmp_path / "tiny")
    info = read_model_info(str(write_tiny_gguf(folder, tmp_path / "tiny.gguf", Q.Q4_1)))
    monkeypatch.setenv("GATEWAY_CPU_QUANT_KERNELS", "0")
    cpu_kernels.load.cache_clear()
    try:
        by_default = load_model(info, torch.device("cpu"), torch.float32)
        assert not any(isinstance(m, QuantLinear | QuantEmbedding) for m in by_default.modules())
        int4 = load_model(info, torch.device("cpu"), torch.float32, quantization="gguf")
        assert isinstance(int4.model.layers[0].self_attn.qkv_proj.weight_q, Int4Weight)
    finally:
        monkeypatch.delenv("GATEWAY_CPU_QUANT_KERNELS")
        cpu_kernels.load.cache_clear()


@pytest.mark.parametrize(("quantization", "one_call", "lone"), [
    ("gguf", "1", 1), ("gguf", "0", 1), ("none", "1", 1),
    ("none", "0", 2)])  # float32 products through torch keep every thread
def test_a_lone_token_of_a_quantized_model_runs_on_one_thread(  # type: ignore[no-untyped-def]
        tmp_path, monkeypatch, quantization: str, one_call: str, lone: int) -> None:
    """...or one whose step is one C call (which splits its products itself)."""
    monkeypatch.setenv("GATEWAY_CPU_LONE_DECODE", one_call)
    folder = build_tiny_llama(tmp_path / "tiny")
    path = write_tiny_gguf(folder, tmp_path / "tiny.gguf", Q.Q4_1)
    worker = _worker(quantization, path, kv_cache_gib=0.01)
    runner = worker.model_runner
    assert runner is not None
    seen: list[int] = []  # torch's thread count during each step's forward
    # (the embedding: the lone token's one-call step runs it too; see lone_decode.py)
    runner.model.model.embed_tokens.register_forward_pre_hook(  # type: ignore[attr-defined]
        lambda *_: seen.append(torch.get_num_threads()))
    torch.set_num_threads(2)  # as a server's worker on 2 cores
    driver = StepDriver(worker, runner.num_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    driver.add("a", list(range(3, 13)), params)
    driver.step()  # the prompt: 10 tokens
    driver.step()  # one token
    driver.add("b", list(range(3, 13)), params)
    driver.step()  # a token and a prompt
    assert torch.get_num_threads() == 2
    assert seen == [2, lone, 2]


def test_quantization_gguf_needs_a_gguf_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    info = read_model_info(str(build_tiny_llama(tmp_path / "tiny")))
    with pytest.raises(ValueError, match="quantization 'gguf' needs a .gguf model file"):
        load_model(info, torch.device("cpu"), torch.float32, quantization="gguf")


# ---------------------------------------------------------------- the default model (Q4_1)
NUM_TOKENS = 16
CHATS = ["Write a haiku about the sea.", "Explain photosynthesis briefly.",
         "Name three primary colours."]
LOGIT_TOLERANCE = 1e-3  # max |logit| difference, quantized (float32 kernels) vs dequantized


def _worker(quantization: str | None = None, model: Path | None = None,
            kv_cache_gib: float = 0.05) -> Worker:
    """A float32 worker with its KV cache, of `model` (None: the default model), at
    `quantization` (None: the default for the file)."""
    worker = Worker(EngineConfig(model=ModelConfig(model=None if model is None else str(model),
                                                   dtype="float32", quantization=quantization),
                                 cache=CacheConfig(kv_cache_memory_gib=kv_cache_gib)))
    worker.init_device()
    worker.load_model()
    worker.initialize_kv_cache()
    return worker


def _greedy(worker: Worker) -> list[list[int]]:
    tokenizer = load_tokenizer(None)
    runner = worker.model_runner
    assert runner is not None
    driver = StepDriver(worker, runner.num_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    requests = [driver.add(f"chat{i}", tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": chat}])), params) for i, chat in enumerate(CHATS)]
    for _ in range(NUM_TOKENS):
        driver.step()
    return [request.output for request in requests]


@pytest.mark.e2e
def test_the_default_model_keeps_its_weights_quantized_and_greedy_tokens_equal() -> None:
    quantized = _worker("gguf")
    model = quantized.model_runner.model  # type: ignore[union-attr]
    assert isinstance(model.lm_head.weight_q, Float32QuantWeight)
    file_bytes = sum(t.num_bytes for t in GGUFFile(default_model_path()).tensors.values())
    assert weight_bytes(model) <= 1.2 * file_bytes
    hidden = torch.randn(4, 576)
    kept_logits, kept_tokens = model.compute_logits(hidden), _greedy(quantized)
    del quantized, model
    dense = _worker("none")
    dense_model = dense.model_runner.model  # type: ignore[union-attr]
    assert (kept_logits - dense_model.compute_logits(hidden)).abs().max() < LOGIT_TOLERANCE
    assert kept_tokens == _greedy(dense)


def _q4_k_m(name: str) -> Q:
    """A Q4_K_M-like mix: attn_v and ffn_down Q6_K, the embedding Q5_0, the rest Q4_K."""
    if "attn_v" in name or "ffn_down" in name:
        return Q.Q6_K
    return Q.Q5_0 if name == "token_embd.weight" else Q.Q4_K


def test_a_k_quant_model_decodes_the_greedy_tokens_of_its_dequantized_weights(  # type: ignore[no-untyped-def]
        tmp_path) -> None:
    """Through the worker (prefills of 20 tokens: the dense product; decodes of one and two
    rows: the block kernels and the one call), a tiny Q4_K_M-like model kept in its blocks
    gives the dequantized float32 model's greedy tokens."""
    folder = build_tiny_llama(tmp_path / "tiny", hidden_size=256, intermediate_size=512,
                              num_attention_heads=4, num_key_value_heads=2)
    path = write_tiny_gguf(folder, tmp_path / "tiny.gguf", qtype_of=_q4_k_m)
    outputs = []
    for quantization in ("gguf", "none"):
        worker = _worker(quantization, path)
        runner = worker.model_runner
        assert runner is not None
        kept = isinstance(runner.model.model.embed_tokens, QuantEmbedding)  # type: ignore[union-attr]
        assert kept == (quantization == "gguf")
        driver = StepDriver(worker, runner.num_blocks)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        first = driver.add("a", list(range(3, 23)), params)
        driver.step()
        driver.step()  # a lone decode
        second = driver.add("b", list(range(40, 60)), params)
        for _ in range(9):
            driver.step()
        outputs.append((first.output, second.output))
    assert min(len(outputs[0][0]), len(outputs[0][1])) >= 8
    assert outputs[0] == outputs[1]
