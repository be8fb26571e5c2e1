"""runtime.heap.settle(): what is alive at start-up leaves the collector's later passes."""

import gc
from collections.abc import Iterator

import pytest

from runtime import heap


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test run keeps the collector as it was


def test_settle_freezes_what_is_alive(unfrozen_after: None) -> None:
    gc.unfreeze()
    kept = [[index] for index in range(1000)]  # tracked containers alive at the moment of settling
    heap.settle()
    assert gc.get_freeze_count() >= len(kept)
    collected = {id(thing) for thing in gc.get_objects()}  # every generation the collector walks
    assert not any(id(item) in collected for item in kept)
    made_later = [0]
    assert id(made_later) in {id(thing) for thing in gc.get_objects()}
