"""8-bit activations for the quantized products (quant_int8.c, and kquant_int8.c for
Q4_K, Q5_K and Q6_K in their file's blocks, through quant_int8.py and quant_weight.py, with
GATEWAY_CPU_INT8_ACTIVATIONS=1): the quantization equals torch's to the bit, every path the
CPU has computes the torch reference of the same int8 math to float32 precision and the
exact float32 product within the 8-bit step, and on the default
model the log-probabilities of a fixed prompt set's greedy tokens stay within a stated
tolerance of the exact products', and the greedy tokens with them wherever the exact
products' top two tokens are further apart than twice that."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gateway.config import CacheConfig, EngineConfig, ModelConfig
from gateway.models.kernels.cpu import quant_int8
from gateway.models.kernels.cpu.library import load
from gateway.models.kernels.cpu.quant_int8 import Int8Path
from gateway.models.kernels.cpu.quant_weight import (
    MAX_BF16_KERNEL_ROWS,
    MIN_BF16_KERNEL_ROWS,
    BlockQuantWeight,
    Float32QuantWeight,
)
from gateway.models.layers.gguf_quant import BlockWeight, QuantWeight
from gateway.platforms.cpu_isa import cpu_isa
from gateway.sampling_params import SamplingParams
from gateway.tokenizer import load_tokenizer
from gateway.worker.worker import Worker
from tests.models.gguf_weights import KEPT, block_weight, quantized_weight
from tests.step_driver import StepDriver

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths


@pytest.fixture(autouse=True)
def _int8_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_CPU_INT8_ACTIVATIONS", "1")

Q = gguf.GGMLQuantizationType
# Relative to the output's largest value: the kernel against the float64 product of the
# same int8 approximation of x (only float32 sums and their order differ) ...
REFERENCE_TOLERANCE = 1e-5
# ... and against the exact product of x (the 8-bit step: up to 1/254 of each group's
# largest value, about 0.6% of the output's largest value measured on random rows).
FLOAT32_TOLERANCE = 2e-2


# The paths this CPU runs, the level aside (the tests call each by name): a path the CPU
# lacks has nothing to run here, and the CPU's own paths are checked against its flags by
# test_the_paths_follow_the_level_python_allows. Without kernels, every path is listed so
# the tests fail on the missing library instead of vanishing.
PATHS = quant_int8.available_paths() or list(Int8Path)


def _kernel(qtype: Q, rows: int) -> tuple[Float32QuantWeight, torch.Tensor]:
    library = load()
    assert library is not None, "the kernels must build on the test machine (cc, AVX2)"
    weight, dequantized = quantized_weight(qtype, rows=rows)
    return Float32QuantWeight(weight, library), dequantized


def test_the_paths_follow_the_level_python_allows() -> None:
    assert {Int8Path.SCALAR, Int8Path.AVX2} <= set(quant_int8.available_paths())
    expected = Int8Path.VNNI if cpu_isa().has_avx512_vnni else Int8Path.AVX2
    assert quant_int8.int8_path() == expected


def test_gateway_cpu_int8_activations_0_keeps_the_exact_products(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_CPU_INT8_ACTIVATIONS", "0")
    assert quant_int8.int8_path() is None
    kernel, dequantized = _kernel(Q.Q4_1, 96)
    x = torch.randn(5, 256)
    expected = x.double() @ dequantized.double().t()
    assert (kernel.matmul(x) - expected).abs().max() < 1e-5 * expected.abs().max()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_rows", [1, 3, 8, 37])
def test_the_quantization_is_torchs_to_the_bit(path: Int8Path, num_rows: int) -> None:
    x = torch.randn(num_rows, 256) * torch.rand(num_rows, 1) * 10
    x[0, :32] = 0.0  # a group of zeros: scale 0, codes 0
    x[-1, 40] = 1e-30  # a tiny value beside ordinary ones rounds to 0
    got, expected = quant_int8.quantize(x, path), quant_int8.reference_quantize(x)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert int(got[0].abs().max()) == 127


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", KEPT)
# weight rows: 96, and 83 (no multiple of anything); x rows: single, the blocks of 4 and
# their remainders, a full decode batch
@pytest.mark.parametrize("weight_rows", [96, 83])
@pytest.mark.parametrize("num_rows", [1, 3, 4, 5, 17, 64])
def test_every_path_computes_the_reference_int8_product(path: Int8Path, qtype: Q,
                                                         weight_rows: int,
                                                         num_rows: int) -> None:
    kernel, dequantized = _kernel(qtype, weight_rows)
    x = torch.randn(num_rows, 256, generator=torch.Generator().manual_seed(num_rows))
    y = quant_int8.matmul(x, kernel.codes, kernel.scales, kernel.minimums, kernel.shape,
                          kernel.bits, path)
    reference = quant_int8.reference_matmul(x, dequantized)
    assert (y - reference).abs().max() < REFERENCE_TOLERANCE * reference.abs().max()
    exact = x.double() @ dequantized.double().t()
    assert (y - exact).abs().max() < FLOAT32_TOLERANCE * exact.abs().max()


@pytest.mark.parametrize("qtype", KEPT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, quant_int8.MIN_INT8_ROWS - 1,
                                      quant_int8.MIN_INT8_ROWS, 9, 100,
                                      quant_int8.MAX_INT8_ROWS, quant_int8.MAX_INT8_ROWS + 1])
def test_matmul_takes_its_range_of_rows_through_8_bit_activations(
        qtype: Q, dtype: torch.dtype, num_rows: int) -> None:
    kernel, dequantized = _kernel(qtype, 96)
    x = torch.randn(num_rows, 256).to(dtype)
    y = kernel.matmul(x)
    assert y.dtype == dtype and y.shape == (num_rows, 96)
    path = quant_int8.int8_path()
    assert path is not None
    int8 = quant_int8.matmul(x.float(), kernel.codes, kernel.scales, kernel.minimums,
                             kernel.shape, kernel.bits, path).to(dtype)
    exact = x.double() @ dequantized.double().t()
    # bfloat16 rows from MIN_BF16_KERNEL_ROWS on keep the AVX512-BF16 kernel where it runs;
    # outside the range, the paths without 8-bit activations
    keeps_bf16_kernel = (dtype == torch.bfloat16 and cpu_isa().has_native_bf16
                         and MIN_BF16_KERNEL_ROWS <= num_rows <= MAX_BF16_KERNEL_ROWS)
    if (quant_int8.MIN_INT8_ROWS <= num_rows <= quant_int8.MAX_INT8_ROWS
            and not keeps_bf16_kernel):
        assert torch.equal(y, int8)
    elif num_rows < quant_int8.MIN_INT8_ROWS and dtype == torch.float32:
        assert (y - exact).abs().max() < 1e-5 * exact.abs().max()  # the float32 kernels
    assert (y.double() - exact).abs().max() < FLOAT32_TOLERANCE * exact.abs().max()


@pytest.mark.parametrize("path", PATHS)
def test_the_extreme_8_bit_codes_do_not_overflow(path: Int8Path) -> None:
    library = load()
    assert library is not None
    codes = torch.tensor([0, 255] * 16 + [255, 0] * 16 + [0] * 32 + [255] * 32,
                         dtype=torch.uint8).view(2, 64)
    scale = torch.tensor([[0.5, 0.25], [1.0, 2.0]])
    weight = QuantWeight(codes, scale, -128 * scale, 8)
    kernel = Float32QuantWeight(weight, library)
    x = torch.tensor([[1.0, -1.0] * 32, [-1.0] * 64, [1.0] * 64])  # q: +-127
    y = quant_int8.matmul(x, kernel.codes, kernel.scales, kernel.minimums, kernel.shape,
                          kernel.bits, path)
    reference = quant_int8.reference_matmul(x, weight.dequantize())
    assert (y - reference).abs().max() < REFERENCE_TOLERANCE * reference.abs().max()


def test_a_path_out_of_range_is_refused() -> None:
    library = load()
    assert library is not None
    x, y = torch.randn(1, 64), torch.empty(1, 16)
    kernel, _ = _kernel(Q.Q4_0, 16)
    for path in (0, 4):
        assert library.gw_quant_matmul_int8(
            x.data_ptr(), 1, 64, kernel.codes.data_ptr(), kernel.scales.data_ptr(),
            kernel.minimums.data_ptr(), 16, 4, y.data_ptr(), path) == -2


# ------------------------------------------------ K-quants in their file's blocks (kquant_int8.c)
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _block_kernel(weight: BlockWeight) -> BlockQuantWeight:
    library = load()
    assert library is not None, "the kernels must build on the test machine (cc, AVX2)"
    return BlockQuantWeight(weight, library)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", K_QUANTS)
# weight rows: 96 (whole tiles of 8), 83 (a last tile of 3); x rows: single, the blocks of
# 4 and their remainders, a full decode batch
@pytest.mark.parametrize("weight_rows", [96, 83])
@pytest.mark.parametrize("num_rows", [1, 3, 4, 5, 17, 64])
def test_every_path_computes_the_reference_kquant_int8_product(path: Int8Path, qtype: Q,
                                                                weight_rows: int,
                                                                num_rows: int) -> None:
    weight, dequantized = block_weight(qtype, rows=weight_rows)  # 512 columns: 2 blocks
    kernel = _block_kernel(weight)
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(num_rows))
    x[0, :256] *= 1e-3  # blocks of x at very different scales
    y = quant_int8.kquant_matmul(x, kernel.address, kernel.shape, path)
    reference = quant_int8.reference_matmul(x, dequantized, quant_int8.K_GROUP)
    assert (y - reference).abs().max() < REFERENCE_TOLERANCE * reference.abs().max()
    exact = x.double() @ dequantized.double().t()
    assert (y - exact).abs().max() < FLOAT32_TOLERANCE * exact.abs().max()


def _fused_q4_k_m_attention() -> tuple[BlockWeight, torch.Tensor]:
    """q and k Q4_K with v Q6_K, as a Q4_K_M file's attention, [80, 512]."""
    parts = [block_weight(qtype, rows=rows, seed=seed)
             for seed, (qtype, rows) in enumerate([(Q.Q4_K, 48), (Q.Q6_K, 16), (Q.Q4_K, 16)])]
    return (BlockWeight.cat_rows([weight for weight, _ in parts]),
            torch.cat([values for _, values in parts]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, quant_int8.MIN_INT8_ROWS - 1,
                                      quant_int8.MIN_INT8_ROWS, 9, 100,
                                      quant_int8.MAX_INT8_ROWS, quant_int8.MAX_INT8_ROWS + 1])
def test_a_kquant_matmul_takes_its_range_of_rows_through_8_bit_activations(
        dtype: torch.dtype, num_rows: int) -> None:
    weight, dequantized = _fused_q4_k_m_attention()
    kernel = _block_kernel(weight)
    x = torch.randn(num_rows, 512).to(dtype)
    y = kernel.matmul(x)
    assert y.dtype == dtype and y.shape == (num_rows, 80)
    path = quant_int8.int8_path()
    assert path is not None
    exact = x.double() @ dequantized.double().t()
    if quant_int8.MIN_INT8_ROWS <= num_rows <= quant_int8.MAX_INT8_ROWS:
        int8 = quant_int8.kquant_matmul(x.float(), kernel.address, kernel.shape, path)
        assert torch.equal(y, int8.to(dtype))
    elif dtype == torch.float32:  # the float32 kernels, or a dense product
        assert (y - exact).abs().max() < 1e-5 * exact.abs().max()
    assert (y.double() - exact).abs().max() < FLOAT32_TOLERANCE * exact.abs().max()


def test_a_block_weight_with_other_parts_keeps_the_float32_products() -> None:
    """Q5_0, Q5_1 and Q8_0 have no 8-bit product of their own: a weight with such a part
    (beside K-quant ones) multiplies exact float32 rows, and the kernel refuses it."""
    parts = [block_weight(qtype, rows=16, seed=seed)
             for seed, qtype in enumerate([Q.Q4_K, Q.Q8_0])]
    fused = BlockWeight.cat_rows([weight for weight, _ in parts])
    dequantized = torch.cat([values for _, values in parts])
    kernel = _block_kernel(fused)
    x = torch.randn(8, 512)
    exact = x.double() @ dequantized.double().t()
    assert (kernel.matmul(x) - exact).abs().max() < 1e-5 * exact.abs().max()
    with pytest.raises(ValueError, match="refused"):
        quant_int8.kquant_matmul(x, kernel.address, kernel.shape, Int8Path.SCALAR)


def _extreme_block(qtype: Q, full: bool, negative: bool) -> np.ndarray:
    """One block of `qtype`, every code its largest (`full`) or 0, every sub-block scale
    its largest (Q6_K: -128 where `negative`), d and dmin 1."""
    one = np.array([1.0], dtype=np.float16).view(np.uint8)
    codes = 0xFF if full else 0
    if qtype == Q.Q6_K:  # ql, qh, 16 int8 scales, d
        scale = np.full(16, -128 if negative else 127, dtype=np.int8).view(np.uint8)
        return np.concatenate((np.full(192, codes, dtype=np.uint8), scale, one))
    tail = np.full(128 + (32 if qtype == Q.Q5_K else 0), codes, dtype=np.uint8)
    return np.concatenate((one, one, np.full(12, 0xFF, dtype=np.uint8), tail))  # 6-bit 63s


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", K_QUANTS)
def test_the_extreme_kquant_blocks_do_not_overflow(path: Int8Path, qtype: Q) -> None:
    blocks = [_extreme_block(qtype, full, negative)
              for full, negative in [(True, True), (True, False), (False, True)]]
    raw = np.stack(blocks)
    weight = BlockWeight.from_gguf(raw.reshape(-1), qtype, (3, 256))
    assert weight is not None
    dequantized = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(3, 256))
    kernel = _block_kernel(weight)
    x = torch.tensor([[1.0] * 256, [-1.0] * 256, [1.0, -1.0] * 128])  # q: +-127
    y = quant_int8.kquant_matmul(x, kernel.address, kernel.shape, path)
    reference = quant_int8.reference_matmul(x, dequantized, quant_int8.K_GROUP)
    assert (y - reference).abs().max() < REFERENCE_TOLERANCE * reference.abs().max()


# ---------------------------------------------------------------- the default model (Q4_1)
NUM_TOKENS = 16
CHATS = ["Write a haiku about the sea.", "Explain photosynthesis briefly.",
         "Name three primary colours.", "What is the capital of France?",
         "Give me a short tip for learning to cook.",
         "Translate 'good morning' into Spanish."]
# The log-probabilities of the greedy tokens, 8-bit activations against exact float32
# products: at most this far apart (nats) at any position the two runs share (measured:
# 0.14 on the AVX-512 VNNI path, 0.15 on the AVX2 one). A greedy token may then differ
# only where the exact run's top two tokens are within twice this; after that the runs
# follow different texts and are not compared.
LOGPROB_TOLERANCE = 0.2


def _greedy_with_logprobs(int8: bool, monkeypatch: pytest.MonkeyPatch,
                          ) -> tuple[list[list[int]], list[list[list[float]]]]:
    """The default model's (Q4_1 kept, float32 activations) greedy tokens of CHATS, all in
    one batch, and per token the log-probabilities [chosen, first, second]."""
    monkeypatch.setenv("GATEWAY_CPU_INT8_ACTIVATIONS", "1" if int8 else "0")
    worker = Worker(EngineConfig(model=ModelConfig(model=None, dtype="float32",
                                                   quantization="gguf"),
                                 cache=CacheConfig(kv_cache_memory_gib=0.05)))
    worker.init_device()
    worker.load_model()
    worker.initialize_kv_cache()
    runner = worker.model_runner
    assert runner is not None
    tokenizer = load_tokenizer(None)
    driver = StepDriver(worker, runner.num_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            logprobs=2)
    requests = [driver.add(f"chat{i}", tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": chat}])), params) for i, chat in enumerate(CHATS)]
    logprobs: dict[str, list[list[float]]] = {request.req_id: [] for request in requests}
    for _ in range(NUM_TOKENS):
        output = driver.step()
        for req_id, token_logprobs in output.logprobs.items():
            logprobs[req_id].append(list(token_logprobs.logprobs))
    return ([request.output for request in requests],
            [logprobs[request.req_id] for request in requests])


@pytest.mark.e2e
def test_the_default_model_keeps_its_log_probabilities_with_8_bit_activations(
        monkeypatch: pytest.MonkeyPatch) -> None:
    exact_tokens, exact_logprobs = _greedy_with_logprobs(False, monkeypatch)
    tokens, logprobs = _greedy_with_logprobs(True, monkeypatch)
    gaps, flips = [], 0
    for row, exact_row, got, expected in zip(logprobs, exact_logprobs, tokens, exact_tokens,
                                             strict=True):
        for (chosen, *_), (exact_chosen, first, second), token, exact_token in zip(
                row, exact_row, got, expected, strict=True):
            if token != exact_token:
                assert first - second < 2 * LOGPROB_TOLERANCE  # a near tie, and no other
                flips += 1
                break
            gaps.append(abs(chosen - exact_chosen))
    print(f"largest log-probability gap: {max(gaps):.4f} over {len(gaps)} tokens; "
          f"{flips} of {len(CHATS)} continuations part at a near tie")
    assert max(gaps) < LOGPROB_TOLERANCE
