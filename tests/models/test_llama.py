"""Our Llama equals transformers' LlamaForCausalLM (float32, within 1e-4) at every step of
a mixed batch: sequences of different lengths, chunked prefills beside decodes, requests
joining, finishing and being preempted, in HF folders and in a GGUF written from one."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from gateway.config import CacheConfig, EngineConfig, ModelConfig
from gateway.sampling_params import SamplingParams
from gateway.worker.worker import Worker
from tests.models.tiny_gguf import write_tiny_gguf
from tests.step_driver import StepDriver
from tests.tiny_model import build_tiny_llama

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths

GREEDY = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
TOLERANCE = 1e-4


def _variant(folder: Path, **changes) -> Path:  # type: ignore[no-untyped-def]
    """The tiny model with config changes (weights reused: shapes do not change)."""
    config = json.loads((folder / "config.json").read_text())
    if "rope_scaling" in changes:  # the older config.json spelling, as many checkpoints have
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config.update(changes)
    target = Path(tempfile.mkdtemp(prefix=f"{folder.name}-", dir=folder.parent))
    for item in folder.iterdir():
        if item.name != "config.json":
            (target / item.name).write_bytes(item.read_bytes())
    (target / "config.json").write_text(json.dumps(config))
    if changes.get("tie_word_embeddings"):  # a tied checkpoint has no lm_head.weight
        weights = load_file(target / "model.safetensors")
        del weights["lm_head.weight"]
        save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


def _worker(model: Path, dtype: str = "float32", max_model_len: int | None = None,
            ) -> tuple[Worker, StepDriver, list[torch.Tensor]]:
    worker = Worker(EngineConfig(model=ModelConfig(model=str(model), dtype=dtype,
                                                   max_model_len=max_model_len),
                                 cache=CacheConfig(kv_cache_memory_gib=0.01)))
    worker.init_device()
    worker.load_model()
    num_blocks = worker.initialize_kv_cache()
    runner = worker.model_runner
    assert runner is not None
    captured: list[torch.Tensor] = []  # each step's logits, as the sampler gets them
    sample = runner.sampler.sample_on_device  # (a lone decode's come from its one C call)

    def capture(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        captured.append(logits.float().clone())
        return sample(logits, *args, **kwargs)

    runner.sampler.sample_on_device = capture  # type: ignore[method-assign]
    return worker, StepDriver(worker, num_blocks), captured


def _reference(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _check_step(driver: StepDriver, output, captured, reference,  # type: ignore[no-untyped-def]
                tolerance: float) -> int:
    """Each sampled request's logits equal the reference's on the same tokens."""
    by_id = {r.req_id: r for r in driver.running}
    for row, req_id in enumerate(output.req_ids):
        tokens = by_id[req_id].all_tokens[:-1]  # what the model saw
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1]
        difference = (captured[-1][row] - expected).abs().max().item()
        assert difference < tolerance, (req_id, len(tokens), difference)
        if tolerance == TOLERANCE:
            assert output.sampled_token_ids[row] == int(expected.argmax())
    return len(output.req_ids)


def _mixed_batch_run(model: Path, reference, dtype: str = "float32",  # type: ignore[no-untyped-def]
                     tolerance: float = TOLERANCE) -> int:
    worker, driver, captured = _worker(model, dtype)
    vocab = worker.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = {f"r{i}": torch.randint(3, vocab, (n,), generator=generator).tolist()
               for i, n in enumerate([1, 3, 17, 29, 40, 70, 5])}
    checked = 0

    def step(budget: int = 48, only: list[str] | None = None) -> None:
        nonlocal checked
        output = driver.step(budget, only)
        if output.req_ids:
            checked += _check_step(driver, output, captured, reference, tolerance)

    for req_id in ("r0", "r1", "r2", "r3"):
        driver.add(req_id, prompts[req_id], GREEDY)
    step()  # r0, r1, r2 whole; r3's first 27 tokens (chunked)
    driver.add("r4", prompts["r4"], GREEDY)
    step()  # 3 decodes (SDPA path), r3's last chunk, r4 whole
    driver.add("r5", prompts["r5"], GREEDY)
    for _ in range(3):
        step()  # 5 decodes (matmul path) beside r5's chunks
    driver.finish("r1")  # its row is refilled by a move
    driver.preempt("r2")  # recomputed from prompt + output as a new request
    driver.add("r6", prompts["r6"], GREEDY)
    for _ in range(3):
        step(budget=64)
    step(only=["r4"])  # a lone decode
    for _ in range(16):  # decodes cross block boundaries
        step(budget=64)
    return checked


def test_logits_equal_transformers_in_mixed_batches(tiny: Path) -> None:
    assert _mixed_batch_run(tiny, _reference(tiny)) > 80


@pytest.mark.parametrize("changes", [
    {"tie_word_embeddings": True},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
     "rope_theta": 500.0},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
], ids=["tied", "llama3-rope", "linear-rope"])
def test_config_variants_equal_transformers(tiny: Path, changes: dict) -> None:
    model = _variant(tiny, **changes)
    assert _mixed_batch_run(model, _reference(model)) > 80


def test_gguf_weights_equal_the_hf_checkpoint(tiny: Path, tmp_path: Path) -> None:
    """A GGUF written like llama.cpp (Q/K permuted) loads back into HF's layout."""
    path = write_tiny_gguf(tiny, tmp_path / "tiny.gguf")
    assert _mixed_batch_run(path, _reference(tiny)) > 80


def test_bfloat16_stays_close_to_the_float32_reference(tiny: Path) -> None:
    """bfloat16 runs other kernels (oneDNN-packed linears on CPU, if present)."""
    assert _mixed_batch_run(tiny, _reference(tiny), "bfloat16", tolerance=0.03) > 80


def test_unsupported_rope_scaling_is_named(tiny: Path) -> None:
    model = _variant(tiny, rope_scaling={"rope_type": "mrope", "mrope_section": [2, 3, 3]})
    with pytest.raises(ValueError, match="rope scaling type 'mrope' is not supported"):
        _worker(model)


def _decode_run(model: Path, reference, lengths: list[int], decode_steps: int,  # type: ignore[no-untyped-def]
                interleave: bool = False) -> tuple[int, set[tuple[int, int]]]:
    """Prefill `lengths` (in 16-token chunks taken in turn when `interleave`, so their
    blocks alternate in the cache), then decode them all together; every sampled row is
    checked. Returns the rows checked and the (batch, blocks) shapes the decodes ran at."""
    worker, driver, captured = _worker(model)
    runner = worker.model_runner
    shapes: set[tuple[int, int]] = set()
    add_decodes = runner.attention.add_decodes

    def record(meta, rows, context_lens) -> None:  # type: ignore[no-untyped-def]
        add_decodes(meta, rows, context_lens)
        bias = meta.decode_bias
        shapes.add((meta.decode_batch, -1 if bias is None else bias.shape[-1] // 16))

    runner.attention.add_decodes = record  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(1)
    for i, n in enumerate(lengths):
        driver.add(f"r{i}", torch.randint(3, worker.vocab_size, (n,), generator=generator).tolist(),
                   GREEDY)
    checked = 0
    while any(r.num_computed < len(r.prompt) for r in driver.running):
        pending = [r.req_id for r in driver.running if r.num_computed < len(r.prompt)]
        for req_id in (pending if interleave else [None]):
            output = driver.step(16 if interleave else 4096, None if req_id is None else [req_id])
            checked += _check_step(driver, output, captured, reference, TOLERANCE)
    for _ in range(decode_steps):
        checked += _check_step(driver, driver.step(), captured, reference, TOLERANCE)
    return checked, shapes


@pytest.mark.parametrize(("lengths", "expected_shape"), [
    ([3, 20, 33, 120, 7, 64, 90, 17, 140], (10, 10)),  # 9 sequences, 9 blocks: both padded
    ([70, 5, 130], (3, 10)),  # a few sequences (SDPA with a mask), 9 blocks padded
], ids=["matmul-padded", "sdpa-padded"])
def test_bucketed_decode_equals_transformers(tiny: Path, lengths: list[int],
                                             expected_shape: tuple[int, int]) -> None:
    checked, shapes = _decode_run(tiny, _reference(tiny), lengths, decode_steps=2)
    assert checked >= 3 * len(lengths)
    assert expected_shape in shapes


@pytest.mark.parametrize("interleave", [False, True], ids=["blocks-in-a-row", "blocks-apart"])
def test_lone_decode_equals_transformers(tiny: Path, interleave: bool) -> None:
    """One sequence decoding alone reads its blocks in place when they follow each other
    in the cache, and gathers them when another sequence's blocks sit between."""
    reference = _reference(tiny)
    worker, driver, captured = _worker(tiny)
    generator = torch.Generator().manual_seed(2)
    for req_id in ("a", "b") if interleave else ("a",):
        driver.add(req_id, torch.randint(3, worker.vocab_size, (40,), generator=generator).tolist(),
                   GREEDY)
    checked = 0
    for _ in range(3):  # 16-token chunks; taking turns, their blocks alternate
        for req_id in [r.req_id for r in driver.running]:
            checked += _check_step(driver, driver.step(16, [req_id]), captured, reference,
                                   TOLERANCE)
    a = next(r for r in driver.running if r.req_id == "a")
    assert all(y == x + 1 for x, y in zip(a.block_ids, a.block_ids[1:])) != interleave
    threads = torch.get_num_threads()
    for _ in range(20):  # crosses a block boundary
        checked += _check_step(driver, driver.step(64, ["a"]), captured, reference, TOLERANCE)
    assert checked >= 20
    # The lone decode's attention ran on one thread (on a CPU with more) and gave them back.
    assert torch.get_num_threads() == threads
