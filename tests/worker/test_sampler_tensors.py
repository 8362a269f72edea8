"""The sampler on persistent row tensors: the same tokens and errors as the sampler it
replaced (tests/worker/reference_sampler.py) for every option, over batches that mix them
and rows that come, go, move and come back; the seeded streams against torch's
generators; and one read from the device in a decode step of the model runner."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from gateway.config import CacheConfig, EngineConfig, ModelConfig
from gateway.plugins import BatchUpdate, MoveDirectionality
from gateway.sampling_params import SamplingParams as P
from gateway.worker.grammar_bitmask import forbidden_on_device, forbidden_tokens
from gateway.worker.sampler import Sampler
from gateway.worker.sampling_ops import (
    Truncation,
    _top_p_by_sorting,
    _top_p_thresholds,
    row_thresholds,
)
from gateway.worker.seeded_draws import SeededDraws
from gateway.worker.worker import Worker
from tests.step_driver import StepDriver
from tests.tiny_model import build_tiny_llama
from tests.worker import reference_sampler

VOCAB, EOS = 64, 1
ONE_WAY, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP
# One request per option, and some that combine them.
OPTIONS = [
    P(temperature=0.0),
    P(temperature=0.7),
    P(temperature=1.3, top_k=5),
    P(top_p=0.8),
    P(temperature=0.9, top_k=12, top_p=0.6),
    P(min_p=0.2),
    P(temperature=0.5, seed=11),
    P(top_k=8, seed=2**40 + 3),
    P(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
    P(repetition_penalty=1.8, seed=-5),
    P(temperature=0.0, repetition_penalty=0.6, frequency_penalty=-0.4),
    P(logit_bias={7: 6.0, 8: 5.0}, bad_words_token_ids=[[7, 8], [9], [3, 4, 5]]),
    P(temperature=0.0, logit_bias={7: 9.0, 8: 8.0, 9: 7.0},
      bad_words_token_ids=[[7, 8], [8, 7]]),
    P(allowed_token_ids=[2, 3, 5, 40]),
    P(temperature=0.0, allowed_token_ids=[1, 6], presence_penalty=2.0),
    P(temperature=0.0, min_tokens=3, stop_token_ids=[4], logit_bias={EOS: 20.0, 4: 19.0}),
    P(min_tokens=2, top_p=0.9, seed=7),
    P(logit_bias={99: 1.0}),  # outside the vocabulary: every step of it fails
    P(temperature=0.0, bad_words_token_ids=[[30, 31, 32, 33]], seed=4),
]


class Pair:
    """The reference and the sampler under test, fed the same updates and logits; the
    outputs grow as a runner grows them (a failed row's token is dropped)."""

    def __init__(self, host_reads: bool) -> None:
        config = ModelConfig(seed=3)
        self.reference = reference_sampler.Sampler(config, VOCAB, [EOS], torch.device("cpu"))
        self.sampler = Sampler(config, VOCAB, [EOS], torch.device("cpu"),
                               host_reads=host_reads)
        self.outputs: dict[int, list[int]] = {}  # row -> its request's output

    def update(self, batch_size: int, added: list[tuple[int, P, list[int]]] = (),  # type: ignore[assignment]
               removed: list[int] = (), moved: list[tuple[int, int, Any]] = ()) -> None:  # type: ignore[assignment]
        for row in removed:
            self.outputs.pop(row, None)
        entries = []
        for row, params, output in added:
            self.outputs[row] = output
            entries.append((row, params, [5, 6, 7, 5], output))
        for source, target, direction in moved:
            if direction is SWAP:
                self.outputs[source], self.outputs[target] = (self.outputs[target],
                                                              self.outputs[source])
            else:
                self.outputs[target] = self.outputs.pop(source)
        update = BatchUpdate(batch_size, added=entries, removed=list(removed),
                             moved=list(moved))
        self.reference.update_state(update)
        self.sampler.update_state(update)

    def step(self, rows: list[int], logits: torch.Tensor) -> list[int]:
        expected = self.reference.sample(logits.clone(), rows)
        got = self.sampler.sample(logits.clone(), rows)
        assert got[1] == expected[1]
        assert [t for t, r in zip(got[0], rows) if r not in got[1]] == \
            [t for t, r in zip(expected[0], rows) if r not in expected[1]]
        for row, token in zip(rows, got[0]):
            if row not in got[1]:
                self.outputs[row].append(token)
        self.reference.update_state(None)
        self.sampler.update_state(None)
        return got[0]


def logits_for(rows: int, generator: torch.Generator) -> torch.Tensor:
    logits = torch.randn(rows, VOCAB, generator=generator) * 2.5
    logits[:, 7:10] += 3.0  # tokens the bad words and penalties have something to do with
    return logits


@pytest.mark.parametrize("host_reads", [True, False])
def test_tokens_equal_the_reference_sampler_through_batch_changes(host_reads: bool) -> None:
    pair = Pair(host_reads)
    noise = torch.Generator().manual_seed(1)
    shuffle = random.Random(0)
    count = len(OPTIONS)
    pair.update(count, added=[(row, p, []) for row, p in enumerate(OPTIONS)])
    for _ in range(6):
        pair.step(list(range(count)), logits_for(count, noise))
    # Rows sampled out of order and only some of them (others in a chunked prefill).
    for _ in range(3):
        rows = shuffle.sample(range(count), 9)
        pair.step(rows, logits_for(len(rows), noise))
    # Row 2 leaves and a new request takes it; rows 0 and 5 swap; the last row moves down
    # into the hole of row 4.
    pair.update(count - 1, removed=[2, 4], added=[(2, P(top_k=3, seed=9), [])],
                moved=[(0, 5, SWAP), (count - 1, 4, ONE_WAY)])
    count -= 1
    for _ in range(4):
        pair.step(list(range(count)), logits_for(count, noise))
    # Preemption: row 6 (seeded) leaves, and comes back later with the tokens it had.
    output = list(pair.outputs[6])
    params = OPTIONS[6]
    pair.update(count, removed=[6])
    pair.update(count, added=[(6, params, output)])
    # The batch grows past the tables' first sizes.
    more = [(count + i, OPTIONS[(i * 5) % len(OPTIONS)], [3, 3, 7]) for i in range(12)]
    pair.update(count + 12, added=more)
    count += 12
    for _ in range(6):
        pair.step(list(range(count)), logits_for(count, noise))
    assert sum(len(o) for o in pair.outputs.values()) > 200


def test_penalties_and_bad_words_follow_a_request_readded_with_its_output() -> None:
    pair = Pair(host_reads=False)
    params = P(temperature=0.0, frequency_penalty=2.0, bad_words_token_ids=[[7, 8]])
    pair.update(1, added=[(0, params, [7, 7, 7])])
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8], logits[0, 9] = 6.5, 3.0, 0.5
    # 7 is penalised by 2 per 7 out: 0.5 left (tied with 9, the argmax takes 7), then
    # -1.5; 8 is a bad word after a 7, and allowed again after the 9.
    tokens = [pair.step([0], logits) for _ in range(3)]
    assert tokens == [[7], [9], [8]]


# ---------------------------------------------------------------- seeded streams
@pytest.mark.parametrize("seed", [0, 42, 2**32 + 5, -7, 2**63 - 1])
def test_seeded_streams_are_torch_generators_numbers(seed: int) -> None:
    draws = SeededDraws()
    draws.seed(3, seed, skip=700)
    draws.seed(0, seed + 1)
    generator = torch.Generator().manual_seed(seed & (2**64 - 1))
    torch.rand(700, generator=generator)
    expected = torch.rand(1400, generator=generator).numpy()

    got = np.concatenate([draws.draw(np.array([3, 0]))[:1] for _ in range(600)]
                         + [draws.draw_run(3, 800)])

    np.testing.assert_array_equal(got, expected)


# ---------------------------------------------------------------- device paths
def test_top_p_by_sorting_equals_the_histogram() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(24, 3000, generator=generator) * torch.linspace(0.5, 6, 24)[:, None]
    p = torch.linspace(0.05, 0.99, 24)

    torch.testing.assert_close(_top_p_by_sorting(logits, p), _top_p_thresholds(logits, p),
                               rtol=0, atol=0)


def test_thresholds_read_nothing_back_without_host_reads() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 500, generator=generator)
    k = np.array([5, 500, 500, 20, 500, 500])
    p = np.array([1.0, 0.9, 1.0, 0.5, 0.7, 1.0], dtype=np.float32)
    min_p = np.array([0.0, 0.0, 0.1, 0.0, 0.2, 0.0], dtype=np.float32)
    rows = Truncation(k, p, min_p, *(torch.from_numpy(a) for a in (k, p, min_p)))
    expected = row_thresholds(logits, rows, host_reads=True)

    with HostReads() as reads:
        got = row_thresholds(logits, rows, host_reads=False)

    assert reads.names == []
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_grammar_mask_unpacked_by_torch_equals_numpy() -> None:
    words = np.random.default_rng(0).integers(-2**31, 2**31, size=(4, 5)).astype(np.int32)
    for vocab in (150, 160, 170):
        assert torch.equal(forbidden_on_device(torch.from_numpy(words), vocab),
                           forbidden_tokens(words, vocab))


# ---------------------------------------------------------------- host reads of a step
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu,
          torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
          torch.Tensor.__index__, torch.Tensor.__array__}


class HostReads(TorchFunctionMode):
    """Records every read of a tensor's values into Python or numpy (on a GPU, each one
    waits for the device to finish its queue), and every `torch.tensor(..., device=)`
    (a copy the host waits for). On the CPU the same calls are the same code path: what
    would wait on a GPU is counted here, whatever the device."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _READS or (func in (torch.tensor, torch.as_tensor)
                              and kwargs.get("device") is not None):
            self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def test_the_counter_sees_each_kind_of_read() -> None:
    tensor = torch.arange(3)
    with HostReads() as reads:
        tensor.tolist(), tensor[0].item(), int(tensor[1]), bool(tensor[2] > 0)
        np.asarray(tensor), float(tensor[0]), torch.tensor([1], device="cpu")
    assert len(reads.names) == 7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


def _decode_step_reads(model: Path, host_reads: bool) -> tuple[list[str], list[Any]]:
    worker = Worker(EngineConfig(model=ModelConfig(model=str(model), dtype="float32"),
                                 cache=CacheConfig(kv_cache_memory_gib=0.01)))
    worker.init_device()
    worker.load_model()
    driver = StepDriver(worker, worker.initialize_kv_cache())
    assert worker.model_runner is not None
    worker.model_runner.sampler.host_reads = host_reads
    mixed = [P(temperature=0.0, logprobs=2), P(top_p=0.9, seed=1, logprobs=0),
             P(top_k=20, min_p=0.1), P(presence_penalty=1.0, repetition_penalty=1.2),
             P(bad_words_token_ids=[[5, 6]], logit_bias={5: 2.0}, min_tokens=4),
             P(allowed_token_ids=[10, 11, 12], temperature=0.5)]
    for i, params in enumerate(mixed):
        driver.add(f"r{i}", list(range(3 + i, 20 + i)), params)
    outputs = [driver.step()]  # the prefill
    with HostReads() as reads:
        outputs.append(driver.step())  # a decode step: one token per request
    outputs += [driver.step() for _ in range(3)]
    return reads.names, outputs


def test_a_decode_step_reads_the_device_once(tiny: Path) -> None:
    names, outputs = _decode_step_reads(tiny, host_reads=False)
    on_cpu_names, on_cpu_outputs = _decode_step_reads(tiny, host_reads=True)

    assert names == ["tolist"]  # the tokens, whether each could be sampled, the logprobs
    assert len(on_cpu_names) > 1  # the CPU path reads the top-p histogram's width
    assert outputs == on_cpu_outputs
    assert len(outputs[1].req_ids) == 6 and set(outputs[1].logprobs) == {"r0", "r1"}
    assert len(outputs[1].logprobs["r0"].token_ids) == 3
