"""vLLM with data parallelism, checked without vLLM: which ranks' KV event publishers a worker subscribes to (each
engine core publishes on its own port, vLLM's ``vllm/distributed/kv_events.py``:
``ZmqEventPublisher.offset_endpoint_port``, the base port + the core's ``data_parallel_index``), each rank's
events renamed by its own map and published as that rank's, and a load report per rank (vLLM makes one stat
logger per engine index: ``vllm/v1/metrics/loggers.py``, ``StatLoggerManager``)."""

from typing import Any

import msgspec
import pytest

from engines.shared.engine_block_names import EngineBlockNames
from engines.vllm.engine import VllmEngine, local_dp_ranks, rank_endpoints
from engines.vllm.settings import VllmSettings
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored, KvEvent

ZMQ = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}


@pytest.mark.parametrize(
    ("kwargs", "ranks"),
    [
        ({}, (0, 1)),
        ({"data_parallel_size": 4}, (0, 4)),
        ({"data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_start_rank": 2}, (2, 2)),
        ({"data_parallel_size": 4, "data_parallel_size_local": 4}, (0, 4)),
    ],
)
def test_the_ranks_a_node_runs_come_from_vllms_data_parallel_arguments(
    kwargs: dict[str, Any], ranks: tuple[int, int]
) -> None:
    assert local_dp_ranks(kwargs) == ranks


def test_each_rank_is_heard_on_the_port_after_the_previous_ranks() -> None:
    fields = {**ZMQ, "endpoint": "tcp://*:5557"}
    assert rank_endpoints(fields, 0, 2) == {0: "tcp://127.0.0.1:5557", 1: "tcp://127.0.0.1:5558"}
    assert rank_endpoints(fields, 2, 2) == {2: "tcp://127.0.0.1:5559", 3: "tcp://127.0.0.1:5560"}


@pytest.mark.parametrize(
    "fields",
    [
        {**ZMQ, "enable_kv_cache_events": False, "endpoint": "tcp://*:5557"},
        {**ZMQ, "publisher": "null", "endpoint": "tcp://*:5557"},
        {**ZMQ, "endpoint": "tcp://router.example:5557"},  # vLLM connects out to a subscriber there
        {**ZMQ, "endpoint": "ipc:///tmp/kv"},
        {**ZMQ, "endpoint": "tcp://*:0"},  # the OS's port: not known here
    ],
)
def test_a_user_config_this_worker_cannot_hear_names_no_endpoint(fields: dict[str, Any]) -> None:
    assert rank_endpoints(fields, 0, 1) == {}


class Sink:
    def __init__(self) -> None:
        self.heard: list[tuple[int, list[KvEvent]]] = []

    def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
        self.heard.append((dp_rank, events))


def stored_batch(engine_hashes: list[int], tokens: list[int], block_size: int) -> Any:
    """A decoded KVEventBatch as vLLM's publisher sends it: [ts, [BlockStored...], dp_rank] (array-like)."""
    stored = ["BlockStored", engine_hashes, None, tokens, block_size, None, None, None]
    return msgspec.msgpack.decode(msgspec.msgpack.encode([1.0, [stored], None]))


def test_each_ranks_events_are_renamed_by_its_own_map_and_published_as_its_own() -> None:
    engine = VllmEngine(VllmSettings(model="m"))
    engine._names = {0: EngineBlockNames(4), 1: EngineBlockNames(4)}
    sink = Sink()
    engine.attach_kv_events(sink)
    tokens = list(range(8))
    engine._publish_batch(1, stored_batch([101, 102], tokens, 4))
    # Rank 1's block is known to rank 1 only: the router asks each rank for its own cache.
    [(rank, [event])] = sink.heard
    assert rank == 1 and isinstance(event, BlockStored)
    assert event.block_hashes == sequence_block_hashes(tokens, 4)
    held = [name for stored in engine.cache_state(1)[1] for name in stored.block_hashes]
    assert held == event.block_hashes and engine.cache_state(0) == {0: []}
    assert set(engine.cache_state(None)) == {0, 1}
    engine._publish_batch(7, stored_batch([103], tokens[:4], 4))  # a rank this node does not run: dropped
    assert len(sink.heard) == 1


def test_each_rank_reports_its_own_load() -> None:
    engine = VllmEngine(VllmSettings(model="m"))
    engine._stats.rank(0).running = 3
    engine._stats.rank(1).waiting = 5
    loads = engine.load()
    assert [(load.dp_rank, load.running, load.waiting) for load in loads] == [(0, 3, 0), (1, 0, 5)]
