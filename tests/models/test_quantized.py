"""GGUF Q4_0, Q4_1 and Q8_0 weights kept quantized: the int4 kernel's zero point, exact
codes, matmuls of both kernels (the gateway's float32 ones and torch's int4) close to the
dequantized weight, the tiny and the default model loading quantized by default, and the
default model's greedy tokens equal to the dequantized model's."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gateway.config import CacheConfig, EngineConfig, ModelConfig
from gateway.models.info.gguf_file import GGUFFile
from gateway.models.info.paths import default_model_path, read_model_info
from gateway.models.kernels.cpu import library as cpu_kernels
from gateway.models.kernels.cpu.quant_weight import (
    MAX_BF16_KERNEL_ROWS,
    MAX_KERNEL_ROWS,
    Float32QuantWeight,
    has_bf16_products,
)
from gateway.models.layers.gguf_quant import QuantWeight
from gateway.models.layers.quant_linear import Int4Weight, QuantEmbedding, QuantLinear, QuantMatrix
from gateway.models.loading.loader import load_model
from gateway.models.loading.quantized import weight_bytes
from gateway.platforms.cpu_isa import cpu_isa
from gateway.sampling_params import SamplingParams
from gateway.tokenizer import load_tokenizer
from gateway.worker.worker import Worker
from tests.models.tiny_gguf import write_tiny_gguf
from tests.models.wide_rows import wide_bf16_rows
from tests.step_driver import StepDriver
from tests.tiny_model import build_tiny_llama

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths

Q = gguf.GGMLQuantizationType
KEPT = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
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


def _quantized(qtype: Q, rows: int = 96, cols: int = 256) -> tuple[QuantWeight, torch.Tensor]:
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    weight = QuantWeight.from_gguf(raw.reshape(-1).view(np.uint8), qtype, (rows, cols))
    assert weight is not None
    return weight, torch.from_numpy(gguf.quants.dequantize(raw, qtype))


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
    weight, expected = _quantized(qtype)
    assert weight.bits == (8 if qtype == Q.Q8_0 else 4)
    assert torch.equal(weight.dequantize(), expected)


# weight rows: 96, whole tiles of the float32 kernels' many-row path; 83, a part tile of 3
# rows (int4 takes whole blocks of 16 rows only)
@pytest.mark.parametrize(("kernel", "weight_rows"), [("float32", 96), ("float32", 83),
                                                     ("int4", 96)])
@pytest.mark.parametrize("qtype", KEPT)
# the kernels (float32: up to 7 rows in blocks of 4, from 8 in tiles of 8 weight rows);
# above 8 (int4) or 64 (float32) rows a dense matmul
@pytest.mark.parametrize("num_rows", [1, 3, 5, 8, 11, 40, 100])
def test_a_quantized_matmul_is_close_to_the_dequantized_weights(kernel: str, weight_rows: int,
                                                                qtype: Q, num_rows: int) -> None:
    weight, dequantized = _quantized(qtype, rows=weight_rows)
    x = torch.randn(num_rows, 256, dtype=torch.float64).float()
    expected = (x.double() @ dequantized.double().t()).float()
    y = _kernel(kernel, weight).matmul(x)
    assert y.dtype == torch.float32 and y.shape == expected.shape
    assert (y - expected).abs().max() < MATMUL_TOLERANCE[kernel] * expected.abs().max()


def test_the_float32_kernels_take_bfloat16_activations() -> None:
    weight, dequantized = _quantized(Q.Q4_1)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    with wide_bf16_rows(False):  # the float32 kernel itself, with a conversion each way
        y = _kernel("float32", weight).matmul(x)
    assert y.dtype == torch.bfloat16
    # float32 sums rounded once to bfloat16: within half a bfloat16 step of the exact value
    # (an exact comparison with the float64 product's rounding failed for some inputs)
    exact = x.double() @ dequantized.double().t()
    assert ((y.double() - exact).abs() <= exact.abs() * 2.0**-8 * (1 + 1e-5)).all()


# bfloat16 rows, MIN_ to MAX_BF16_KERNEL_ROWS, run gw_quant_matmul_bf16 where the CPU has
# AVX512-BF16 and the weight's rows are whole blocks of 16 (96 and 80, an odd number of
# blocks; 83 is not): its products of bfloat16 values and codes are exact and summed in
# float32, so it is as close to the dequantized weights as the float32 kernel. Elsewhere
# the float32 kernel runs.
@pytest.mark.parametrize("qtype", KEPT)
@pytest.mark.parametrize("weight_rows", [96, 80, 83])
@pytest.mark.parametrize("num_rows", [2, 4, 7, 17, 40, MAX_BF16_KERNEL_ROWS])
def test_bfloat16_rows_run_the_avx512_bf16_kernel_with_float32_sums(
        qtype: Q, weight_rows: int, num_rows: int) -> None:
    weight, dequantized = _quantized(qtype, rows=weight_rows)
    kernel = _kernel("float32", weight)
    assert isinstance(kernel, Float32QuantWeight)
    x = torch.randn(num_rows, 256).bfloat16()
    expected = x.double() @ dequantized.double().t()
    library = cpu_kernels.load()
    assert library is not None
    sums = torch.empty(num_rows, weight_rows)  # the kernel's float32 output, before rounding
    status = library.gw_quant_matmul_bf16(
        x.data_ptr(), num_rows, 256, kernel.codes.data_ptr(), kernel.scales.data_ptr(),
        kernel.minimums.data_ptr(), weight_rows, kernel.bits, sums.data_ptr(), 0)
    runs = cpu_isa().has_native_bf16 and weight_rows % 16 == 0
    assert status == (0 if runs else -2)
    assert has_bf16_products() == cpu_isa().has_native_bf16
    if runs:
        assert (sums.double() - expected).abs().max() < 1e-5 * expected.abs().max()
    y = kernel.matmul(x)
    assert y.dtype == torch.bfloat16 and y.shape == expected.shape
    if not runs and num_rows > MAX_KERNEL_ROWS:
        # a dense product of the weight dequantized to bfloat16 (rounded: prefill's path)
        assert (y.double() - expected).abs().max() < 0.01 * expected.abs().max()
        return
    # rounded once to bfloat16 from float32 sums: within half a bfloat16 step, and a little
    assert ((y.double() - expected).abs() <= expected.abs() * 2.0**-8 + 1e-5
            * expected.abs().max()).all()
    with wide_bf16_rows(False):
        assert not has_bf16_products()
        float32_kernel = kernel.matmul(x.float())  # the float32 kernel on the same values
    assert (y.double() - float32_kernel.double()).abs().max() <= 2.0**-8 * expected.abs().max()


@pytest.mark.parametrize("kernel", ["float32", "int4"])
@pytest.mark.parametrize("qtype", KEPT)
def test_embedding_rows_are_the_dequantized_rows(kernel: str, qtype: Q) -> None:
    weight, dequantized = _quantized(qtype)
    ids = torch.tensor([0, 1, 15, 16, 31, 32, 33, 63, 64, 95])
    rows = QuantEmbedding(_kernel(kernel, weight), torch.float32)(ids)
    tolerance = MATMUL_TOLERANCE[kernel] * dequantized.abs().max()
    assert (rows - dequantized[ids]).abs().max() <= tolerance


def test_the_float32_kernels_dequantize_exactly_and_refuse_rows_outside() -> None:
    weight, dequantized = _quantized(Q.Q8_0)
    kernel = _kernel("float32", weight)
    assert torch.equal(kernel.dequantize(torch.float32), dequantized)
    with pytest.raises(IndexError, match="rows outside the weight's 96"):
        kernel.dequantize(torch.float32, torch.tensor([3, 96]))


def test_the_float32_kernels_run_on_the_openmp_library_torch_loaded() -> None:
    library = cpu_kernels.load()
    assert library is not None

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    def provider(handle: ctypes.CDLL, symbol: str) -> str:
        info = DlInfo()
        address = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p)
        assert ctypes.CDLL(None).dladdr(address, ctypes.byref(info))
        return os.path.realpath(info.fname.decode())

    torch_cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                         "libtorch_cpu.so"))
    # one thread pool, which torch.set_num_threads sizes
    assert provider(library, "GOMP_parallel") == provider(torch_cpu, "omp_get_max_threads")


def test_columns_off_the_groups_cannot_be_cut() -> None:
    weight, _ = _quantized(Q.Q4_1)
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
