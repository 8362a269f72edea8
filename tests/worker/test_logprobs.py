"""The worker's logprob arithmetic: the chosen token's logprob and rank, the top N."""

from __future__ import annotations

import torch

from gateway.sampling_params import SamplingParams
from gateway.worker.logprobs import gather, raw_logprobs, rows_wanting_logprobs


def test_gather_gives_the_chosen_token_its_rank_and_the_top_n():
    logprobs = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0],
                                               [5.0, 0.0, 0.0, 1.0]]), dim=-1)
    first, second = gather(logprobs, [2, 0], [2, 0])
    assert first.token_ids == [2, 1, 3] and first.rank == 3
    assert torch.allclose(torch.tensor(first.logprobs), logprobs[0, [2, 1, 3]])
    assert second.token_ids == [0] and second.rank == 1


def test_only_the_rows_that_ask_are_computed():
    class Row:
        def __init__(self, logprobs):
            self.sampling_params = SamplingParams(logprobs=logprobs)

    rows = [Row(None), Row(0), Row(None), Row(5)]
    assert rows_wanting_logprobs(rows) == [1, 3]
    logits = torch.randn(4, 10)
    assert raw_logprobs(logits, []) is None
    computed = raw_logprobs(logits, [1, 3])
    assert computed is not None and computed.shape == (2, 10)
    assert torch.allclose(computed, torch.log_softmax(logits[[1, 3]], dim=-1))
