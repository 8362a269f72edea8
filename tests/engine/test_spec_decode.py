"""Speculative decoding (n-gram drafts, and a draft model) through the real engine core and
worker (tiny fp32 models): greedy tokens identical to those without drafts, with prefix
caching, chunked prefill and preemption; stop conditions inside accepted drafts; blocks of
rejected drafts and of the draft model's lookahead released; requests whose options are
not built for drafts run without them; sampled tokens that follow the target's
distribution."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from gateway.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from gateway.engine.core import EngineCore
from gateway.engine.ngram_proposer import NgramProposer
from gateway.messages import EngineCoreRequest
from gateway.sampling_params import SamplingParams

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * BLOCK_SIZE * 4  # K and V, 2 layers, 2 kv heads, dim 16, fp32
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    passage = [rng.randrange(3, 430) for _ in range(12)]
    return {"repeats": passage * 4, "short-cycle": passage[:6] * 5,
            "random": [rng.randrange(3, 430) for _ in range(30)],
            "shares-prefix": passage * 4 + [7, 8, 9]}


def _engine(model: Path, speculative: SpeculativeConfig | None, num_blocks: int = 1024,
            budget: int = 32, prefix_caching: bool = True) -> EngineCore:
    """`num_blocks` blocks of the tiny model's KV (a draft of the same shape takes its
    share: the budget holds twice its bytes per block)."""
    bytes_per_block = BYTES_PER_BLOCK * (2 if speculative is not None
                                         and speculative.uses_draft_model else 1)
    return EngineCore(EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE,
                          kv_cache_memory_gib=num_blocks * bytes_per_block / 1024**3,
                          enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
        speculative=speculative))


def _run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]],
         ) -> tuple[dict[str, list[int]], list[int], int]:
    """Every request's tokens, [drafts, draft tokens, accepted] and the preemptions."""
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    counts, preemptions = [0, 0, 0], 0
    try:
        for rid, (prompt, params) in requests.items():
            assert engine.add_request(EngineCoreRequest(rid, prompt, params, 0.0)) is None
        while engine.has_work():
            outputs = engine.step()
            for output in outputs.outputs:
                assert output.error is None, output.error
                tokens[output.request_id] += output.new_token_ids
            _check_blocks(engine)
            stats = outputs.iteration_stats
            if stats is not None and stats.spec_decoding_stats is not None:
                spec = stats.spec_decoding_stats
                counts = [counts[0] + spec.num_drafts, counts[1] + spec.num_draft_tokens,
                          counts[2] + spec.num_accepted_tokens]
                assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
            assert outputs.scheduler_stats is not None
            preemptions += outputs.scheduler_stats.num_preemptions
        kv_cache = engine.scheduler.kv_cache
        assert kv_cache.num_free_blocks == kv_cache.num_blocks  # everything released
    finally:
        engine.shutdown()
    return tokens, counts, preemptions


def _check_blocks(engine: EngineCore) -> None:
    """After a step a request holds no block beyond its known tokens (those of rejected
    drafts are released) and its computed tokens never run past them."""
    for request in engine.scheduler.running:
        assert len(request.block_ids) <= -(-request.num_tokens // BLOCK_SIZE)
        assert request.num_computed_tokens <= request.num_tokens - 1


@pytest.mark.parametrize(("num_blocks", "budget"), [
    (1024, 32),  # chunked prefill beside drafting rows, prefix cache hits
    (40, 64),  # a small pool: preemption by recompute drops the drafts
])
def test_greedy_tokens_with_drafts_equal_those_without(tiny_llama, num_blocks, budget):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = {rid: (prompt, params) for rid, prompt in _prompts().items()}
    plain, no_drafts, _ = _run(_engine(tiny_llama, None, num_blocks, budget), requests)
    assert no_drafts == [0, 0, 0]
    spec, (num_drafts, num_draft_tokens, accepted), preemptions = _run(
        _engine(tiny_llama, SPEC, num_blocks, budget), requests)
    assert spec == plain
    assert num_drafts > 0 and 0 < accepted < num_draft_tokens  # some accepted, some not
    if num_blocks == 40:
        assert preemptions > 0


def test_stop_conditions_inside_accepted_drafts_end_the_output_as_without(tiny_llama):
    prompt = _prompts()["repeats"]
    free_run, _, _ = _run(_engine(tiny_llama, None), {"a": (prompt, SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True))})
    stop_token = free_run["a"][30]  # where the output repeats itself: drafts are accepted
    requests = {
        "stop-token": (prompt, SamplingParams(temperature=0.0, max_tokens=40,
                                              stop_token_ids=[stop_token])),
        "max-tokens": (prompt, SamplingParams(temperature=0.0, max_tokens=27,
                                              ignore_eos=True)),
    }
    plain, _, _ = _run(_engine(tiny_llama, None), requests)
    spec, (num_drafts, _, accepted), _ = _run(_engine(tiny_llama, SPEC), requests)
    assert spec == plain
    assert plain["max-tokens"] == free_run["a"][:27]
    assert plain["stop-token"][-1] == stop_token
    assert num_drafts > 0 and accepted > 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, min_tokens=5),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={5: 1.0}),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                   bad_words_token_ids=[[5, 6]]),
    SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=3),
], ids=["logprobs", "prompt_logprobs", "penalty", "min_tokens", "logit_bias", "bad_words",
        "seed"])
def test_requests_not_built_for_drafts_run_without_them(tiny_llama, params):
    requests = {"a": (_prompts()["repeats"], params)}
    plain, _, _ = _run(_engine(tiny_llama, None), requests)
    spec, counts, _ = _run(_engine(tiny_llama, SPEC), requests)
    assert spec == plain
    assert counts == [0, 0, 0]


def test_sampled_requests_verify_drafts(tiny_llama):
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=30,
                            ignore_eos=True)
    requests = {rid: (prompt, params) for rid, prompt in _prompts().items()}
    spec, (num_drafts, _, accepted), _ = _run(_engine(tiny_llama, SPEC), requests)
    assert all(len(tokens) == 30 for tokens in spec.values())
    assert num_drafts > 0 and accepted > 0


@pytest.mark.parametrize(("tokens", "expected"), [
    ([1, 2, 3, 4, 1, 2, 3], [4, 1, 2]),  # the longest suffix (3) at its first occurrence
    ([9, 2, 3, 5, 7, 3, 6, 9, 2, 3], [5, 7, 3]),
    ([1, 2, 3, 4], []),  # no earlier occurrence
    ([5, 5], [5]),  # the continuation stops at the end
])
def test_the_proposer_looks_up_the_longest_suffix(tokens, expected):
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                               prompt_lookup_max=3))
    assert proposer.propose(tokens, max_drafts=8) == expected
    assert proposer.propose(tokens, max_drafts=1) == expected[:1]


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny random Llama, other weights, the same tokenizer: a draft model that
    mostly disagrees with the target."""
    from tests.tiny_model import build_tiny_llama
    return build_tiny_llama(tmp_path_factory.mktemp("other-llama"), seed=1)


def _draft(model: Path, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(model), num_speculative_tokens=k)


@pytest.mark.parametrize(("num_blocks", "budget", "prefix_caching"), [
    (1024, 32, True),  # chunked prefill beside drafting rows, prefix cache hits
    (1024, 32, False),
    (40, 64, True),  # a small pool: preemption by recompute drops the drafts
])
@pytest.mark.parametrize("same_weights", [True, False], ids=["same-weights", "other-weights"])
def test_greedy_tokens_with_a_draft_model_equal_those_without(
        tiny_llama, other_llama, num_blocks, budget, prefix_caching, same_weights):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = {rid: (prompt, params) for rid, prompt in _prompts().items()}
    plain, _, _ = _run(_engine(tiny_llama, None, num_blocks, budget, prefix_caching), requests)
    draft = _draft(tiny_llama if same_weights else other_llama)
    spec, (num_drafts, num_draft_tokens, accepted), preemptions = _run(
        _engine(tiny_llama, draft, num_blocks, budget, prefix_caching), requests)
    assert spec == plain
    assert num_drafts > 0
    if same_weights:  # the draft's argmax is the target's: every draft is accepted
        assert accepted == num_draft_tokens
    else:
        assert accepted < num_draft_tokens
    if num_blocks == 40:
        assert preemptions > 0


def test_a_draft_model_without_free_lookahead_slots_drafts_nothing_and_preempts_no_one(
        tiny_llama):
    """Two requests that fill the pool but for one block: near their ends the lookahead
    slots are not free, so they decode without drafts; no request is preempted."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    rng = random.Random(1)
    requests = {rid: ([rng.randrange(3, 430) for _ in range(30)], params) for rid in "ab"}
    plain, _, plain_preemptions = _run(_engine(tiny_llama, None, num_blocks=22), requests)
    spec, (num_drafts, num_draft_tokens, accepted), preemptions = _run(
        _engine(tiny_llama, _draft(tiny_llama), num_blocks=22), requests)
    assert spec == plain
    assert preemptions == plain_preemptions == 0
    # Without the lookahead check each request would draft after every step (12 tokens
    # in 3 steps of 5); the last steps run without drafts.
    assert 0 < num_drafts and accepted == num_draft_tokens
    assert sum(len(tokens) for tokens in spec.values()) > 5 * num_drafts


def test_the_draft_model_stops_inside_accepted_drafts_as_without(tiny_llama):
    prompt = _prompts()["random"]
    free_run, _, _ = _run(_engine(tiny_llama, None), {"a": (prompt, SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True))})
    requests = {
        "stop-token": (prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                              stop_token_ids=[free_run["a"][17]])),
        "max-tokens": (prompt, SamplingParams(temperature=0.0, max_tokens=13,
                                              ignore_eos=True)),
    }
    plain, _, _ = _run(_engine(tiny_llama, None), requests)
    spec, (num_drafts, _, accepted), _ = _run(_engine(tiny_llama, _draft(tiny_llama)),
                                              requests)
    assert spec == plain
    assert plain["max-tokens"] == free_run["a"][:13]
    assert num_drafts > 0 and accepted > 0


def test_sampled_tokens_with_a_draft_model_follow_the_target_distribution(tiny_llama):
    """The (second, third) tokens of many sampled requests, with drafts (the target's own
    argmax, accepted with its probability) and without speculation: the same distribution
    (two samples, total variation)."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    prompt = _prompts()["random"][:8]
    requests = {str(i): (prompt, params) for i in range(1500)}
    pairs = []
    for speculative in (None, _draft(tiny_llama, k=2)):
        engine = EngineCore(EngineConfig(
            model=ModelConfig(model=str(tiny_llama), dtype="float32"),
            cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_gib=2 * 4096
                              * BYTES_PER_BLOCK / 1024**3),
            scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048),
            speculative=speculative))
        tokens, counts, _ = _run(engine, requests)
        pairs.append(np.array([tokens[rid][1] * 1000 + tokens[rid][2] for rid in requests]))
        if speculative is not None:
            assert counts[0] > 500 and 0 < counts[2] < counts[1]
    categories = np.unique(np.concatenate(pairs))
    frequencies = [np.array([(sample == c).mean() for c in categories]) for sample in pairs]
    assert 0.5 * np.abs(frequencies[0] - frequencies[1]).sum() < 0.1


def test_the_kv_budget_holds_the_blocks_of_both_models(tiny_llama, other_llama):
    """The draft's cache has the target's blocks, sized from both models' bytes per block:
    a draft of the target's shape halves the blocks a budget holds."""
    num_blocks = []
    for speculative in (None, _draft(other_llama)):
        engine = EngineCore(EngineConfig(
            model=ModelConfig(model=str(tiny_llama), dtype="float32"),
            cache=CacheConfig(block_size=BLOCK_SIZE,
                              kv_cache_memory_gib=64 * BYTES_PER_BLOCK / 1024**3),
            speculative=speculative))
        num_blocks.append(engine.scheduler.kv_cache.num_blocks)
        engine.shutdown()
    assert num_blocks == [64, 32]
