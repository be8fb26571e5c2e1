"""The predicting index of ``--use-kv-events false``: routed prefixes kept for a TTL, at most so many."""

import pytest

from frontend_gateway.routing.kv_indexer import PredictedKvIndexer

A, B = (1, 0), (2, 0)
HASHES = [11, 12, 13, 14]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_routed_prefix_is_assumed_cached_until_its_ttl_passes() -> None:
    clock = Clock()
    index = PredictedKvIndexer(ttl_s=120, max_blocks=100, clock=clock)
    index.record(A, HASHES)
    clock.now += 119.9
    assert index.find_matches(HASHES) == {A: 4}
    clock.now += 0.2
    assert index.find_matches(HASHES) == {}
    assert len(index) == 0


def test_routing_a_prefix_again_renews_its_ttl() -> None:
    clock = Clock()
    index = PredictedKvIndexer(ttl_s=10, max_blocks=100, clock=clock)
    index.record(A, HASHES)
    clock.now += 8
    index.record(A, HASHES[:2])
    clock.now += 8  # 16 s after the first routing, 8 s after the second
    assert index.find_matches(HASHES) == {A: 2}


def test_beyond_the_size_bound_the_least_recently_routed_blocks_go_first() -> None:
    clock = Clock()
    index = PredictedKvIndexer(ttl_s=120, max_blocks=6, clock=clock)
    index.record(A, HASHES)
    index.record(B, [21, 22])
    index.record(A, HASHES[:1])  # touched again: now the most recent
    index.record(B, [23, 24])  # 8 entries: the two least recent (A's 12 and 13) go
    assert len(index) == 6
    assert index.find_matches(HASHES) == {A: 1}
    assert index.find_matches([21, 22, 23, 24]) == {B: 4}


def test_two_workers_routed_the_same_prefix_both_match() -> None:
    index = PredictedKvIndexer(ttl_s=120, max_blocks=100)
    index.record(A, HASHES)
    index.record(B, HASHES[:2])
    assert index.find_matches(HASHES) == {A: 4, B: 2}


def test_removing_an_instance_forgets_its_predicted_blocks() -> None:
    index = PredictedKvIndexer(ttl_s=120, max_blocks=100)
    index.record(A, HASHES)
    index.record(B, HASHES)
    index.remove_instance(1)
    assert index.find_matches(HASHES) == {B: 4}
    assert len(index) == 4


@pytest.mark.parametrize(("ttl_s", "max_blocks"), [(0, 10), (-1, 10), (10, 0)])
def test_a_ttl_or_size_bound_that_would_keep_nothing_is_refused(ttl_s: float, max_blocks: int) -> None:
    with pytest.raises(ValueError, match="ttl_s must be > 0 and max_blocks >= 1"):
        PredictedKvIndexer(ttl_s=ttl_s, max_blocks=max_blocks)
