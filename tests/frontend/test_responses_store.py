"""The responses store's bounds: count (the oldest goes first) and age."""

from __future__ import annotations

from gateway.frontend.openai.responses_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _put(store: ResponseStore, response_id: str) -> None:
    store.put(response_id, [{"role": "user", "content": response_id}], {"id": response_id})


def test_past_its_count_the_oldest_response_goes_first():
    store = ResponseStore(max_entries=2, max_age_s=60)
    for response_id in ("a", "b", "c"):
        _put(store, response_id)
    assert store.get("a") is None
    assert [store.get(i).response["id"] for i in ("b", "c")] == ["b", "c"]
    assert len(store) == 2


def test_storing_an_id_again_makes_it_the_newest():
    store = ResponseStore(max_entries=2, max_age_s=60)
    for response_id in ("a", "b", "a", "c"):
        _put(store, response_id)
    assert store.get("b") is None and store.get("a") is not None


def test_a_response_older_than_the_age_bound_is_gone():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_age_s=30, clock=clock)
    _put(store, "old")
    clock.now += 20
    _put(store, "new")
    clock.now += 15  # "old" is 35 s old, "new" 15 s
    assert store.get("old") is None
    assert store.get("new").messages == [{"role": "user", "content": "new"}]
    clock.now += 30
    assert len(store) == 0
