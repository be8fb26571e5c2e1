"""launcher.heap.settle(): what is alive at start-up leaves the collector's later passes."""

import gc
from collections.abc import Iterator

import pytest

from launcher import heap


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()  # the rest of the test run keeps the collector as it was
    gc.set_threshold(*thresholds)


def test_settle_freezes_what_is_alive(unfrozen_after: None) -> None:
    gc.unfreeze()
    kept = [[index] for index in range(1000)]  # tracked containers alive at the moment of settling
    heap.settle()
    assert gc.get_freeze_count() >= len(kept)
    collected = {id(thing) for thing in gc.get_objects()}  # every generation the collector walks
    assert not any(id(item) in collected for item in kept)
    made_later = [0]
    assert id(made_later) in {id(thing) for thing in gc.get_objects()}


def test_settle_collects_the_young_generation_only_after_real_growth(unfrozen_after: None) -> None:
    heap.settle()
    assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD
    young_passes = gc.get_stats()[0]["collections"]
    for _ in range(20):  # requests come and go: tracked objects made and freed, net growth ~0
        in_flight = [[token] for token in range(2000)]
        del in_flight
    assert gc.get_stats()[0]["collections"] == young_passes
    grown = [[token] for token in range(heap.YOUNG_THRESHOLD + 1000)]  # a cache filling up
    assert gc.get_stats()[0]["collections"] > young_passes
    assert len(grown) == heap.YOUNG_THRESHOLD + 1000
