"""A mocker worker over real etcd and NATS: its KV events, load reports and cache state, as routers see them.

The worker is a real ``flotilla run in=dyn://... out=mocker`` process behind a real ingress; the test
listens on NATS as a KV router does (``kv_events`` and ``load_metrics`` subjects) and asks the worker
for its cache state on its ``kv_state`` subject.
"""

import asyncio
import base64
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from runtime.addressing import EndpointAddress
from runtime.discovery import MODELS_PREFIX
from runtime.endpoint import ModelEntry
from runtime.kv_blocks import sequence_block_hashes
from runtime.kv_events import BlockStored, KvEventBatch, KvStateRequest, WorkerLoad
from runtime.kv_publisher import KvEventPublisher
from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.infra import EtcdServer

MODEL = "llm"
ADDRESS = EndpointAddress(MODEL)
BLOCK = 16
SETTINGS = {"speedup_ratio": 1000, "block_size": BLOCK, "num_gpu_blocks": 512, "dp_size": 2}


class NatsListener:
    """Records the KV event batches and load reports published on NATS, on a thread of its own."""

    def __init__(self, nats_url: str) -> None:
        self._url = nats_url
        self.batches: list[KvEventBatch] = []
        self.loads: list[WorkerLoad] = []
        self._changed = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nats listener", daemon=True)
        self._nc = NATS()

    def __enter__(self) -> "NatsListener":
        self._thread.start()
        self._call(self._subscribe())
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._call(self._nc.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def wait_for(self, condition: Callable[["NatsListener"], bool], timeout: float, message: str) -> None:
        """Return once ``condition(self)`` holds (checked at each message); AssertionError after ``timeout``."""
        with self._changed:
            if not self._changed.wait_for(lambda: condition(self), timeout):
                raise AssertionError(message)

    def ask_state(self, instance_id: int, dp_rank: int) -> KvEventBatch:
        """The worker's answer to a KvStateRequest for ``dp_rank``."""
        request = msgspec.msgpack.encode(KvStateRequest(dp_rank=dp_rank))
        reply: Msg = self._call(self._nc.request(ADDRESS.kv_state_subject(instance_id), request, timeout=5))
        return msgspec.msgpack.decode(reply.data, type=KvEventBatch)

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=15)

    async def _subscribe(self) -> None:
        await self._nc.connect(self._url)

        async def on_events(message: Msg) -> None:
            self._record(self.batches, msgspec.msgpack.decode(message.data, type=KvEventBatch))

        async def on_load(message: Msg) -> None:
            self._record(self.loads, msgspec.json.decode(message.data, type=WorkerLoad))

        await self._nc.subscribe(ADDRESS.kv_events_subject(), cb=on_events)
        await self._nc.subscribe(ADDRESS.load_metrics_subject(), cb=on_load)
        await self._nc.flush()

    def _record(self, into: list[Any], item: Any) -> None:
        with self._changed:
            into.append(item)
            self._changed.notify_all()


def registered_block_size(etcd: EtcdServer) -> int:
    """The KV block size in the model card the worker registered (over etcd's JSON API)."""

    def encode(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    body = {"key": encode(MODELS_PREFIX), "range_end": encode(MODELS_PREFIX[:-1] + chr(ord(MODELS_PREFIX[-1]) + 1))}
    kvs = httpx.post(etcd.endpoint + "/v3/kv/range", json=body, timeout=5).json()["kvs"]
    entry = msgspec.json.decode(base64.b64decode(kvs[0]["value"]), type=ModelEntry)
    return entry.card.kv_cache_block_size


def stored_hashes(batches: list[KvEventBatch], instance_id: int, dp_rank: int) -> list[int]:
    return [
        block_hash
        for batch in batches
        if (batch.instance_id, batch.dp_rank) == (instance_id, dp_rank)
        for event in batch.events
        if isinstance(event, BlockStored)
        for block_hash in event.block_hashes
    ]


def test_a_mocker_worker_publishes_kv_events_load_and_cache_state(cluster: Cluster, tmp_path: Path) -> None:
    settings = tmp_path / "mocker.json"
    settings.write_text(json.dumps(SETTINGS))
    prompt = list(range(1000, 1000 + 4 * BLOCK))
    with NatsListener(cluster.nats.url) as listener:
        ingress = cluster.start_ingress()
        worker = cluster.start_worker(
            f"dyn://{MODEL}", "out=mocker", "--model-name", MODEL, "--extra-engine-args", str(settings)
        )
        instance_id = int(worker.instance_id, 16)
        wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
        assert registered_block_size(cluster.etcd) == BLOCK

        body = {"model": MODEL, "prompt": prompt, "max_tokens": 5}
        first = httpx.post(ingress.base_url + "/v1/completions", json=body, timeout=30)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["completion_tokens"] == 5
        again = httpx.post(ingress.base_url + "/v1/completions", json=body, timeout=30)
        assert again.status_code == 200, again.text
        # All but the last block of the prompt: vLLM (and the mocker) computes at least one token.
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK

        expected = sequence_block_hashes(prompt, BLOCK)
        listener.wait_for(
            lambda seen: stored_hashes(seen.batches, instance_id, 0)[:4] == expected,
            10,
            "the prompt's blocks were not published as stored",
        )
        own = [batch for batch in listener.batches if batch.instance_id == instance_id]
        assert [batch.event_id for batch in own] == list(range(1, len(own) + 1))
        # 64 prompt tokens and 5 generated fill 4 blocks; the repeat shares them and stores nothing new.
        assert [event for batch in own for event in batch.events] == [BlockStored(expected, None)]

        listener.wait_for(
            lambda seen: {load.dp_rank for load in seen.loads if load.instance_id == instance_id} == {0, 1},
            10,
            "no load report for both dp ranks",
        )
        report = next(load for load in listener.loads if load.instance_id == instance_id and load.dp_rank == 0)
        assert report.kv_total_blocks == 512
        assert report.active_requests == 0 and report.kv_active_blocks == 0

        state = listener.ask_state(instance_id, 0)
        assert (state.instance_id, state.dp_rank, state.event_id) == (instance_id, 0, 0)
        cached = [block for event in state.events if isinstance(event, BlockStored) for block in event.block_hashes]
        assert cached[:4] == expected
        other = listener.ask_state(instance_id, 1)
        assert (other.dp_rank, other.events) == (1, [])


def test_a_kv_routing_ingress_sends_a_cached_prefix_to_the_mocker_that_holds_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    settings = tmp_path / "mocker.json"
    settings.write_text(json.dumps({**SETTINGS, "dp_size": 1}))
    with NatsListener(cluster.nats.url) as listener:
        ingress = cluster.start_ingress("--router-mode", "kv")
        workers = [
            cluster.start_worker(
                f"dyn://{MODEL}", "out=mocker", "--model-name", MODEL, "--extra-engine-args", str(settings)
            )
            for _ in range(2)
        ]
        wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")

        def complete(prompt: list[int]) -> str:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            reply = httpx.post(ingress.base_url + "/v1/completions", json=body, timeout=30)
            assert reply.status_code == 200, reply.text
            return str(reply.headers["x-flotilla-instance"])

        # Nothing cached anywhere: the router breaks ties at random, so both workers show up.
        seen: set[str] = set()
        fresh = iter(range(40_000, 49_000))
        wait_until(lambda: seen.add(complete([next(fresh)] * 4)) or len(seen) == 2, 30, "a worker never got a request")

        prefix = list(range(3000, 3000 + 8 * BLOCK))
        holder = complete(prefix)
        blocks = sequence_block_hashes(prefix, BLOCK)
        listener.wait_for(
            lambda seen: stored_hashes(seen.batches, int(holder, 16), 0)[:8] == blocks, 10, "no stored event"
        )
        served = [complete([*prefix, *range(9000 + 10 * turn, 9000 + 10 * turn + 5)]) for turn in range(5)]
        assert served == [holder] * 5, f"the prefix is on {holder}; {[w.instance_id for w in workers]}"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "launcher.cli", "run", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)


def test_bad_mocker_settings_stop_the_worker_with_exit_code_2_and_the_key(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"speedup": 10}')
    result = run_cli(f"in=dyn://{MODEL}", "out=mocker", "--extra-engine-args", str(unknown))
    assert result.returncode == 2
    assert "unknown key 'speedup'" in result.stderr and "speedup_ratio" in result.stderr
    assert "Traceback" not in result.stderr

    bad = tmp_path / "bad.json"
    bad.write_text('{"num_gpu_blocks": -5}')
    result = run_cli(f"in=dyn://{MODEL}", "out=mocker", env={**os.environ, "FLOTILLA_EXTRA_ENGINE_ARGS": str(bad)})
    assert result.returncode == 2
    assert "bad value for key 'num_gpu_blocks'" in result.stderr


def test_extra_engine_args_for_an_engine_that_takes_none_is_refused(tmp_path: Path) -> None:
    settings = tmp_path / "mocker.json"
    settings.write_text("{}")
    result = run_cli("out=echo_core", "--extra-engine-args", str(settings))
    assert result.returncode == 2
    assert "configures out=mocker" in result.stderr


class FlakyNats:
    """Stands in for a NATS connection whose next publish fails (a reconnect); records the rest."""

    def __init__(self) -> None:
        self.published: list[KvEventBatch] = []
        self.fail_next = False
        self.changed = asyncio.Event()

    async def publish(self, subject: str, data: bytes) -> None:
        assert subject == ADDRESS.kv_events_subject()
        if self.fail_next:
            self.fail_next = False
            raise nats.errors.ConnectionClosedError
        self.published.append(msgspec.msgpack.decode(data, type=KvEventBatch))
        self.changed.set()


class NoCache:
    def attach_kv_events(self, sink: object) -> None: ...

    def load(self) -> list[WorkerLoad]:
        return []

    def cache_state(self, dp_rank: int | None) -> dict[int, list[BlockStored]]:
        return {}


async def test_a_batch_nats_refuses_is_lost_but_numbered_and_publishing_goes_on() -> None:
    connection = FlakyNats()
    publisher = KvEventPublisher(connection, ADDRESS, 7, NoCache(), interval=0)  # type: ignore[arg-type]
    publisher.publish(0, [BlockStored([1])])
    publisher.publish(1, [BlockStored([9])])
    publisher.publish(0, [BlockStored([2], 1)])
    connection.fail_next = True
    await publisher.flush()
    assert publisher.batches_lost == 1
    assert connection.published == [KvEventBatch(instance_id=7, dp_rank=1, event_id=1, events=[BlockStored([9])])]

    connection.changed.clear()
    publishing = asyncio.create_task(publisher.publish_forever())
    try:
        publisher.publish(0, [BlockStored([3])])
        await connection.changed.wait()
    finally:
        publishing.cancel()
    # Rank 0's first batch was lost: its next one is numbered 2, so a router sees the gap.
    assert connection.published[-1] == KvEventBatch(instance_id=7, dp_rank=0, event_id=2, events=[BlockStored([3])])
