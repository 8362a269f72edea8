"""The persistent batch: rows stay dense, and each step's BatchUpdate says how they moved."""

from __future__ import annotations

from gateway.messages import CachedRequestData, NewRequestData, SchedulerOutput
from gateway.plugins.contracts import MoveDirectionality
from gateway.sampling_params import SamplingParams
from gateway.worker.input_batch import InputBatch

PARAMS = SamplingParams(temperature=0.0)


def _new(req_id: str, blocks: list[int], output: list[int] | None = None) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=[1, 2, 3], sampling_params=PARAMS,
                          block_ids=blocks, output_token_ids=output or [])


def _step(new: list[NewRequestData] = (), cached: list[CachedRequestData] = (),  # type: ignore[assignment]
          finished: list[str] = ()) -> SchedulerOutput:  # type: ignore[assignment]
    return SchedulerOutput(scheduled_new_reqs=list(new), scheduled_cached_reqs=list(cached),
                           num_scheduled_tokens={}, finished_req_ids=list(finished))


def test_new_requests_take_rows_in_order() -> None:
    batch = InputBatch(max_blocks_per_request=4)
    update = batch.update(_step([_new("a", [3]), _new("b", [5, 6])]))
    assert update is not None and update.batch_size == 2
    assert [(row, prompt) for row, _, prompt, _ in update.added] == [(0, [1, 2, 3]),
                                                                   (1, [1, 2, 3])]
    assert batch.block_table[1, :2].tolist() == [5, 6] and batch.num_blocks[1] == 2
    # The output list handed to the sampler is the request's own: it grows in place.
    assert update.added[0][3] is batch.requests["a"].output_token_ids


def test_unchanged_rows_give_no_update() -> None:
    batch = InputBatch(max_blocks_per_request=4)
    batch.update(_step([_new("a", [3])]))
    cached = CachedRequestData(req_id="a", new_block_ids=[7], num_computed_tokens=3)
    assert batch.update(_step(cached=[cached])) is None
    assert batch.block_table[0, :2].tolist() == [3, 7]
    assert batch.requests["a"].num_computed_tokens == 3


def test_a_finished_row_is_refilled_by_a_new_request() -> None:
    batch = InputBatch(max_blocks_per_request=4)
    batch.update(_step([_new("a", [1]), _new("b", [2]), _new("c", [3])]))
    update = batch.update(_step([_new("d", [4])], finished=["b"]))
    assert update is not None
    assert update.removed == [1] and [a[0] for a in update.added] == [1] and not update.moved
    assert batch.row_req_ids == ["a", "d", "c"]


def test_holes_are_filled_by_moving_the_last_rows_down() -> None:
    batch = InputBatch(max_blocks_per_request=4)
    batch.update(_step([_new(r, [i]) for i, r in enumerate("abcde")]))
    update = batch.update(_step(finished=["a", "c"]))
    assert update is not None and update.batch_size == 3
    assert sorted(update.removed) == [0, 2]
    assert update.moved == [(4, 0, MoveDirectionality.UNIDIRECTIONAL),
                            (3, 2, MoveDirectionality.UNIDIRECTIONAL)]
    assert batch.row_req_ids == ["e", "b", "d"]
    assert batch.req_id_to_row == {"e": 0, "b": 1, "d": 2}
    assert batch.block_table[:3, 0].tolist() == [4, 1, 3]  # block tables move with rows


def test_removing_the_last_rows_needs_no_move() -> None:
    batch = InputBatch(max_blocks_per_request=4)
    batch.update(_step([_new(r, [i]) for i, r in enumerate("abc")]))
    update = batch.update(_step(finished=["c", "b"]))
    assert update is not None and update.batch_size == 1 and not update.moved


def test_a_preempted_request_comes_back_with_its_output() -> None:
    batch = InputBatch(max_blocks_per_request=4)
    batch.update(_step([_new("a", [1])]))
    update = batch.update(_step([_new("a", [9], output=[42, 43])], finished=["a"]))
    assert update is not None and update.removed == [0] and update.added[0][3] == [42, 43]
    assert batch.requests["a"].num_tokens == 5


def test_rows_and_block_tables_grow() -> None:
    batch = InputBatch(max_blocks_per_request=2, initial_rows=2)
    batch.update(_step([_new(f"r{i}", list(range(5))) for i in range(5)]))
    assert batch.num_rows == 5 and batch.block_table[4, :5].tolist() == [0, 1, 2, 3, 4]
