"""`vllm:request_params_n`'s values: one per client request, when its last choice ends."""

from __future__ import annotations

import pytest

from gateway.frontend.outputs.parallel_sampling import ParentRequests
from tests.metrics.helpers import finished


@pytest.mark.parametrize(("steps", "expected"), [
    ([["solo"]], [[1]]),  # not fanned out: n = 1 at once
    ([["p-0", "p-1"], ["p-2"]], [[], [3]]),  # the last of three choices ends it
    ([["p-2", "p-0", "p-1"]], [[3]]),  # all in one step, in any order
    ([["p-0", "solo", "q-0"], ["q-1", "p-1", "p-2"]], [[1], [2, 3]]),
])
def test_a_request_is_counted_once_with_its_n(steps, expected):
    parents = ParentRequests()
    parents.add(["p-0", "p-1", "p-2"])
    parents.add(["q-0", "q-1"])
    assert [parents.n_params([finished(r) for r in step]) for step in steps] == expected


def test_choices_that_never_finish_are_forgotten_oldest_first():
    parents = ParentRequests(max_pending=4)
    parents.add(["old-0", "old-1"])
    parents.add(["new-0", "new-1", "new-2"])
    assert parents.n_params([finished("old-0")]) == [1]  # forgotten: counted as alone
    assert parents.n_params([finished(f"new-{i}") for i in range(3)]) == [3]
