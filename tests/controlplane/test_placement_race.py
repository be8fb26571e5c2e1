"""Two placements at once, on two real database connections (PostgreSQL: SQLite's single writer hides
the race): the second waits for the first, and no GPU is filled twice."""

import contextlib
import os
import threading

import pytest
from django.db import connection

from controlplane.deployments import inventory, upkeep
from controlplane.deployments.models import Instance, Pipeline
from tests.controlplane.factories import TEST_ACTOR, GiB, deploy, make_model, make_node

pytestmark = [
    pytest.mark.postgresql,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not os.environ.get("DATABASE_URL", "").startswith("postgres"),
        reason="two connections racing need PostgreSQL (tests/controlplane/test_postgresql.py runs this there)",
    ),
]


@pytest.fixture
def reads_meet(monkeypatch: pytest.MonkeyPatch) -> threading.Barrier:
    """Each placement, once it has read the fleet's inventory, waits (up to 3 s) for the other to have read
    it too: without a lock both then see the one free GPU; with one, the second reads after the first."""
    barrier = threading.Barrier(2, timeout=3)
    read = inventory.fleet_inventory

    def read_then_meet() -> list[inventory.NodeInventory]:
        found = read()
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()
        return found

    monkeypatch.setattr(upkeep, "fleet_inventory", read_then_meet)
    return barrier


def test_two_placements_at_once_do_not_put_two_replicas_on_one_gpus_last_room(
    reads_meet: threading.Barrier,
) -> None:
    make_node("gpu-a", (80,))
    first = deploy("first", make_model("first", memory_bytes=60 * GiB), gpus_per_replica=1)
    second = deploy("second", make_model("second", memory_bytes=60 * GiB), gpus_per_replica=1)
    errors: list[BaseException] = []

    def place(pipeline: Pipeline) -> None:
        # Each pass places another pipeline's instance (one saw only the first deploy, say).
        try:
            upkeep.place_pending_instances(TEST_ACTOR, pipeline)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)
        finally:
            connection.close()  # each thread has its own connection

    threads = [threading.Thread(target=place, args=(pipeline,)) for pipeline in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert not errors, errors
    placed = Instance.objects.filter(node__isnull=False)
    assert placed.count() == 1, list(placed.values_list("pipeline__name", "gpu_indexes"))
    waiting = Instance.objects.get(node__isnull=True)
    assert "needs 1 GPU with 60 GiB free" in waiting.reason
