"""The sampler: built-in sampling, per-request seeds, and logits-processor plugins."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from gateway.config import ModelConfig
from gateway.plugins import BatchUpdate, MoveDirectionality, loader
from gateway.sampling_params import SamplingParams
from gateway.worker.sampler import Sampler
from tests.plugin_dists import forget_modules
from tests.worker.lp_fakes import BROKEN_MODULE, FORCE_CLASS, MODULES, install

CPU = torch.device("cpu")
EOS = 2
SWAP, ONE_WAY = MoveDirectionality.SWAP, MoveDirectionality.UNIDIRECTIONAL


@pytest.fixture(autouse=True)
def _fresh_plugins() -> Iterator[None]:
    loader.reset_for_tests()
    yield
    loader.reset_for_tests()
    forget_modules(*MODULES)


def make_sampler(vocab_size: int = 32, processors: tuple[str, ...] = (),
                 seed: int = 0) -> Sampler:
    config = ModelConfig(logits_processors=list(processors), seed=seed)
    return Sampler(config, vocab_size, [EOS], CPU)


def add(sampler: Sampler, *params: SamplingParams,
        outputs: list[list[int]] | None = None) -> None:
    """Start a batch of len(params) requests in rows 0.."""
    outputs = outputs or [[] for _ in params]
    added = [(row, p, [1, 2, 3], outputs[row]) for row, p in enumerate(params)]
    sampler.update_state(BatchUpdate(len(params), added=added))


def probs_logits(probs: list[float], vocab_size: int = 32) -> torch.Tensor:
    """One row of logits whose softmax is `probs` on the first tokens, ~0 elsewhere."""
    row = torch.full((vocab_size,), -1e4)
    row[:len(probs)] = torch.tensor(probs).log()
    return row


def draw_many(params: SamplingParams, row: torch.Tensor, num_draws: int = 2000) -> Counter:
    """Sample `num_draws` times from the same logits, as one batch of identical requests."""
    sampler = make_sampler(row.shape[0])
    add(sampler, *[params] * num_draws)
    tokens, errors = sampler.sample(row.repeat(num_draws, 1), list(range(num_draws)))
    assert errors == {}
    return Counter(tokens)


# ---------------------------------------------------------------- built-in sampling
def test_greedy_rows_take_the_argmax():
    sampler = make_sampler(1000)
    add(sampler, *[SamplingParams(temperature=0.0)] * 8)
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))

    tokens, errors = sampler.sample(logits.clone(), list(range(8)))

    assert tokens == logits.argmax(-1).tolist()
    assert errors == {}


def test_greedy_and_sampled_rows_mix_in_one_batch():
    sampler = make_sampler(1000)
    add(sampler, SamplingParams(temperature=0.0), SamplingParams(top_k=1),
        SamplingParams(temperature=0.0))
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2))

    tokens, _ = sampler.sample(logits.clone(), [0, 1, 2])

    assert tokens == logits.argmax(-1).tolist()  # top_k=1 is greedy too


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_distribution(temperature):
    counts = draw_many(SamplingParams(temperature=temperature), probs_logits([0.25, 0.75]),
                       4000)

    expected = 1 / (1 + math.exp(-math.log(3) / temperature))  # softmax of logits / T
    assert set(counts) == {0, 1}
    assert abs(counts[1] / 4000 - expected) < 0.03


def test_top_k_keeps_exactly_the_k_best_tokens():
    counts = draw_many(SamplingParams(top_k=3), probs_logits([0.1, 0.3, 0.05, 0.2, 0.35]))

    assert set(counts) == {1, 3, 4}


@pytest.mark.parametrize(("top_p", "support"), [(0.45, {0}), (0.75, {0, 1}),
                                                 (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_nucleus_reaching_p(top_p, support):
    counts = draw_many(SamplingParams(top_p=top_p), probs_logits([0.5, 0.3, 0.15, 0.05]))

    assert set(counts) == support


@pytest.mark.parametrize(("min_p", "support"), [(0.2, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0})])
def test_min_p_drops_tokens_below_a_fraction_of_the_best(min_p, support):
    counts = draw_many(SamplingParams(min_p=min_p), probs_logits([0.5, 0.3, 0.15, 0.05]))

    assert set(counts) == support


def test_top_p_applies_to_the_top_k_distribution():
    # After top-k=2 the two survivors weigh 0.625 and 0.375: top-p 0.6 keeps one of them.
    counts = draw_many(SamplingParams(top_k=2, top_p=0.6), probs_logits([0.5, 0.3, 0.2]))

    assert set(counts) == {0}


def test_logit_bias_is_added_before_sampling():
    sampler = make_sampler()
    add(sampler, SamplingParams(temperature=0.0, logit_bias={7: 50.0, 0: -50.0}),
        SamplingParams(temperature=0.0))
    logits = torch.zeros(2, 32)
    logits[:, 0] = 10.0

    tokens, errors = sampler.sample(logits, [0, 1])

    assert tokens == [7, 0]
    assert errors == {}


def test_logit_bias_outside_the_vocabulary_fails_that_request_only():
    sampler = make_sampler()
    add(sampler, SamplingParams(logit_bias={99: 1.0}), SamplingParams(temperature=0.0))

    tokens, errors = sampler.sample(torch.zeros(2, 32), [0, 1])

    assert list(errors) == [0]
    assert "logit_bias names token id 99" in errors[0] and "[0, 32)" in errors[0]
    assert tokens[1] == 0


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    sampler = make_sampler()
    output: list[int] = []
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    add(sampler, params, outputs=[output])
    logits = torch.zeros(32)
    logits[EOS], logits[5], logits[9] = 3.0, 2.0, 1.0

    for expected in (9, 9, EOS):
        tokens, _ = sampler.sample(logits.clone().unsqueeze(0), [0])
        assert tokens == [expected]
        output.append(tokens[0])  # the runner's list grows in place
        sampler.update_state(None)


def test_min_tokens_lets_a_stop_id_through_once_reached():
    sampler = make_sampler()
    add(sampler, SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[5]),
        outputs=[[4]])
    logits = torch.zeros(1, 32)
    logits[0, 5] = 1.0

    assert sampler.sample(logits, [0])[0] == [5]


def test_a_row_with_every_token_masked_fails_alone():
    sampler = make_sampler()
    add(sampler, SamplingParams(temperature=0.0), SamplingParams(), SamplingParams())
    logits = torch.zeros(3, 32)
    logits[0] = float("-inf")
    logits[1] = float("nan")

    _, errors = sampler.sample(logits, [0, 1, 2])

    assert sorted(errors) == [0, 1]
    assert "no token can be sampled" in errors[0]


def test_sample_rejects_logits_of_the_wrong_shape_and_empty_rows():
    sampler = make_sampler()
    add(sampler, SamplingParams())

    with pytest.raises(ValueError, match=r"shape \(1, 31\), expected \(1, 32\)"):
        sampler.sample(torch.zeros(1, 31), [0])
    with pytest.raises(ValueError, match="row 3 of the persistent batch holds no request"):
        sampler.sample(torch.zeros(1, 32), [3])


# ---------------------------------------------------------------- seeds
def own_logits() -> torch.Generator:
    """The logits stream of the request under test: the same in every run."""
    return torch.Generator().manual_seed(123)


def seeded_run(sampler: Sampler, row: int, num_rows: int, own: torch.Generator,
               steps: int) -> list[int]:
    """Sample `steps` tokens for the request in `row`, its logits drawn from `own`; the
    other rows' logits differ from run to run."""
    noise = torch.Generator().manual_seed(num_rows * 7 + row)
    tokens = []
    for _ in range(steps):
        logits = torch.randn(num_rows, 500, generator=noise)
        logits[row] = torch.randn(500, generator=own)
        sampled, errors = sampler.sample(logits, list(range(num_rows)))
        assert errors == {}
        tokens.append(sampled[row])
        sampler.update_state(None)
    return tokens


def test_same_seed_gives_the_same_tokens_whatever_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    alone = make_sampler(500)
    add(alone, params)
    crowded = make_sampler(500)
    add(crowded, SamplingParams(), SamplingParams(seed=7), SamplingParams(temperature=0.0),
        params, SamplingParams(top_k=5, seed=42))
    other_seed = make_sampler(500)
    add(other_seed, SamplingParams(temperature=1.0, top_p=0.95, seed=43))

    tokens = seeded_run(alone, 0, 1, own_logits(), 12)

    assert seeded_run(crowded, 3, 5, own_logits(), 12) == tokens
    assert seeded_run(other_seed, 0, 1, own_logits(), 12) != tokens
    assert len(set(tokens)) > 3  # the run really samples


def test_seeded_request_keeps_its_sequence_when_moved_in_the_batch():
    params = SamplingParams(seed=5)
    reference = make_sampler(500)
    add(reference, params)
    expected = seeded_run(reference, 0, 1, own_logits(), 6)
    moving = make_sampler(500)
    add(moving, SamplingParams(), params)
    own = own_logits()

    first = seeded_run(moving, 1, 2, own, 3)
    moving.update_state(BatchUpdate(1, removed=[0], moved=[(1, 0, ONE_WAY)]))
    rest = seeded_run(moving, 0, 1, own, 3)

    assert first + rest == expected


def test_seeded_request_readded_after_preemption_continues_its_sequence():
    params = SamplingParams(seed=9, top_k=50)
    reference = make_sampler(500)
    add(reference, params)
    expected = seeded_run(reference, 0, 1, own_logits(), 6)
    preempted = make_sampler(500)
    add(preempted, params)
    own = own_logits()

    first = seeded_run(preempted, 0, 1, own, 3)
    preempted.update_state(BatchUpdate(0, removed=[0]))
    preempted.update_state(BatchUpdate(1, added=[(0, params, [1, 2, 3], list(first))]))
    rest = seeded_run(preempted, 0, 1, own, 3)

    assert first + rest == expected


def test_unseeded_rows_are_reproducible_from_the_model_seed():
    runs = []
    for seed in (0, 0, 1):
        sampler = make_sampler(500, seed=seed)
        add(sampler, *[SamplingParams()] * 4)
        logits = torch.zeros(4, 500)
        runs.append(sampler.sample(logits, [0, 1, 2, 3])[0])

    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# ---------------------------------------------------------------- logits processors
def forcing(token: int | None = None, temperature: float = 0.0) -> SamplingParams:
    extra = {"force_token": token} if token is not None else None
    return SamplingParams(temperature=temperature, extra_args=extra)


def test_plugin_processor_forces_a_token_for_the_requests_that_ask(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, {"force": FORCE_CLASS})
    sampler = make_sampler()
    add(sampler, forcing(13), forcing(), forcing(21, temperature=1.0))
    logits = torch.zeros(3, 32)
    logits[:, 4] = 5.0

    tokens, errors = sampler.sample(logits, [0, 1, 2])

    assert tokens == [13, 4, 21]
    assert errors == {}


def test_vllm_plugins_naming_something_else_does_not_filter_processors(tmp_path,
                                                                       monkeypatch):
    install(tmp_path, monkeypatch, {"force": FORCE_CLASS})
    monkeypatch.setenv("VLLM_PLUGINS", "some-endpoint-plugin")
    sampler = make_sampler()
    add(sampler, forcing(13))

    assert sampler.sample(torch.zeros(1, 32), [0])[0] == [13]


def test_processor_named_on_the_command_line_runs(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch)  # the module only: no entry point
    sampler = make_sampler(processors=(FORCE_CLASS,))
    add(sampler, forcing(), forcing(30))

    assert sampler.sample(torch.zeros(2, 32), [0, 1])[0] == [0, 30]


def test_processor_sees_persistent_rows_when_a_step_samples_some_of_them(tmp_path,
                                                                         monkeypatch):
    install(tmp_path, monkeypatch, {"force": FORCE_CLASS})
    sampler = make_sampler()
    add(sampler, forcing(11), forcing(), forcing(12), forcing())
    logits = torch.zeros(3, 32)
    logits[:, 5] = 1.0

    # Row 1 is mid-prefill: the step samples rows 3, 2 and 0, in that order.
    tokens, errors = sampler.sample(logits, [3, 2, 0])

    assert tokens == [5, 12, 11]
    assert errors == {}
    assert sampler.sample(torch.zeros(1, 32), [2])[0] == [12]


def test_processor_raising_in_apply_fails_every_row_of_the_step(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch)
    sampler = make_sampler(processors=(f"{BROKEN_MODULE}:RaisesInApply",))
    add(sampler, SamplingParams(temperature=0.0), SamplingParams(seed=3))

    tokens, errors = sampler.sample(torch.zeros(2, 32), [0, 1])

    assert len(tokens) == 2
    assert sorted(errors) == [0, 1]
    assert "RaisesInApply raised in apply(): RuntimeError: boom in apply" in errors[0]


def test_processor_raising_in_update_state_fails_the_next_step_only(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch)
    sampler = make_sampler(processors=(f"{BROKEN_MODULE}:RaisesInUpdateState",))
    add(sampler, SamplingParams(temperature=0.0))

    _, errors = sampler.sample(torch.zeros(1, 32), [0])
    sampler.update_state(None)
    _, next_errors = sampler.sample(torch.zeros(1, 32), [0])

    assert "raised in update_state(): KeyError" in errors[0]
    assert next_errors == {}


def test_processor_returning_the_wrong_shape_fails_the_step(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch)
    sampler = make_sampler(processors=(f"{BROKEN_MODULE}:WrongShape",))
    add(sampler, SamplingParams(temperature=0.0))

    _, errors = sampler.sample(torch.zeros(1, 32), [0])

    assert "apply() returned (1, 3), expected a tensor of shape (1, 32)" in errors[0]


def test_argmax_invariant_processor_is_skipped_when_every_row_is_greedy(tmp_path,
                                                                        monkeypatch):
    install(tmp_path, monkeypatch)
    sampler = make_sampler(processors=(f"{BROKEN_MODULE}:CountsCalls",))
    counter = type(sampler.processors[0])
    add(sampler, SamplingParams(temperature=0.0), SamplingParams(temperature=0.0))

    sampler.sample(torch.zeros(2, 32), [0, 1])
    assert counter.calls == 0
    sampler.update_state(BatchUpdate(2, added=[(1, SamplingParams(), [1], [])]))
    sampler.sample(torch.zeros(2, 32), [0, 1])
    assert counter.calls == 1


# ---------------------------------------------------------------- batch updates
def marked(token: int) -> SamplingParams:
    """A greedy request that always answers `token` (through its logit_bias)."""
    return SamplingParams(temperature=0.0, logit_bias={token: 100.0})


def answers(sampler: Sampler, rows: list[int]) -> list[int]:
    return sampler.sample(torch.zeros(len(rows), 32), rows)[0]


def test_batch_update_applies_removed_then_added_then_moved(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, {"force": FORCE_CLASS})
    sampler = make_sampler()
    add(sampler, marked(10), marked(11), forcing(12))
    assert answers(sampler, [0, 1, 2]) == [10, 11, 12]

    # Remove row 0, add a request there, then swap rows 0 and 2.
    sampler.update_state(BatchUpdate(3, removed=[0], added=[(0, forcing(13), [1], [])],
                                     moved=[(0, 2, SWAP)]))
    assert answers(sampler, [0, 1, 2]) == [12, 11, 13]

    # Remove row 1 and compact: row 2 moves down to row 1.
    sampler.update_state(BatchUpdate(2, removed=[1], moved=[(2, 1, ONE_WAY)]))
    assert answers(sampler, [0, 1]) == [12, 13]
    with pytest.raises(ValueError, match="row 2"):
        answers(sampler, [2])


def test_added_request_replaces_whatever_held_its_row():
    sampler = make_sampler()
    add(sampler, marked(10))

    sampler.update_state(BatchUpdate(1, added=[(0, marked(20), [1], [])]))

    assert answers(sampler, [0]) == [20]
