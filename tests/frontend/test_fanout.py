"""The fan-out of one client request (prompts x n) against an engine client that records
what it is asked: admitted whole, run in a window of half --max-num-seqs, outputs in
order, the reservation given back however the request ends."""

from __future__ import annotations

import asyncio
import gc

import pytest

from gateway.config import EngineConfig, SchedulerConfig
from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.fanout import open_streams, plan_choices, run_to_end
from gateway.outputs import RequestOutput
from gateway.sampling_params import SamplingParams

NUM_STEPS = 3


class _Engine:
    """Each request yields NUM_STEPS outputs; `failing` ids end with an engine error."""

    def __init__(self, max_num_seqs: int, failing: tuple[str, ...] = ()) -> None:
        self.config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
        self.failing = failing
        self.reserved: set[str] = set()
        self.num_live = self.most_live = 0
        self.sent: list[str] = []
        self.closed: list[str] = []

    def reserve(self, request_ids: list[str]) -> None:
        self.reserved |= set(request_ids)

    def release(self, request_ids: list[str]) -> None:
        self.reserved -= set(request_ids)

    def add_parent_request(self, child_request_ids: list[str]) -> None:
        pass

    async def generate(self, prompt_token_ids, params, request_id):
        self.reserved.discard(request_id)
        self.sent.append(request_id)
        self.num_live += 1
        self.most_live = max(self.most_live, self.num_live)
        try:
            for step in range(1, NUM_STEPS + 1):
                await asyncio.sleep(0)
                if request_id in self.failing:
                    yield RequestOutput(request_id, prompt_token_ids, "", "", [], [], True,
                                        "error", error="bad", error_kind="invalid_request")
                    return
                yield RequestOutput(request_id, prompt_token_ids, "x" * step, "x", [7] * step,
                                    [7], step == NUM_STEPS, "length" if step == NUM_STEPS
                                    else None)
        finally:
            self.num_live -= 1
            self.closed.append(request_id)


class _Request:
    """An HTTP request whose client stays."""

    async def receive(self):
        await asyncio.Event().wait()


def _choices(num_prompts: int, n: int):
    return plan_choices("cmpl-x", [[1, 2]] * num_prompts,
                        [SamplingParams(max_tokens=NUM_STEPS)] * num_prompts, n)


def test_a_fan_out_runs_in_a_window_of_half_the_batch_and_answers_in_order():
    engine = _Engine(max_num_seqs=4)
    choices = _choices(5, 2)
    finals = asyncio.run(run_to_end(engine, _Request(), choices))
    assert [f.request_id for f in finals] == [c.request_id for c in choices]
    assert all(f.finished and f.text == "x" * NUM_STEPS for f in finals)
    assert engine.most_live == 2 and engine.sent == [c.request_id for c in choices]
    assert engine.reserved == set()


def test_a_streamed_fan_out_runs_in_a_window_and_merges_every_choice():
    engine = _Engine(max_num_seqs=4)
    choices = _choices(3, 3)

    async def run():
        outputs = await open_streams(engine, _Request(), choices)
        return [pair async for pair in outputs]

    pairs = asyncio.run(run())
    for choice in choices:
        texts = [output.text for index, output in pairs if index == choice.index]
        assert texts == ["x" * step for step in range(1, NUM_STEPS + 1)]
    assert engine.most_live == 2 and sorted(engine.closed) == sorted(engine.sent)
    assert engine.reserved == set()


def test_a_failing_choice_stops_the_others_and_gives_back_the_rest():
    choices = _choices(8, 1)
    engine = _Engine(max_num_seqs=4, failing=(choices[2].request_id,))
    with pytest.raises(OpenAIError):
        asyncio.run(run_to_end(engine, _Request(), choices))
    assert len(engine.sent) < len(choices)  # the later ones were never sent
    assert engine.num_live == 0 and engine.reserved == set()


def test_a_stream_that_never_starts_gives_back_its_reservation():
    engine = _Engine(max_num_seqs=2)
    choices = _choices(4, 1)

    async def run():
        outputs = await open_streams(engine, _Request(), choices)
        assert engine.reserved == {c.request_id for c in choices[1:]}
        del outputs  # the response never started (its client left first)
        gc.collect()

    asyncio.run(run())
    assert engine.reserved == set()
