"""A mocker worker over real etcd and NATS: its KV events, load reports and cache state, as routers see them.

The worker is a real ``flotilla run in=dyn://... out=mocker`` process behind a real ingress; the test
listens on NATS as a KV router does (``kv_events`` and ``load_metrics`` subjects) and asks the worker
for its cache state on its ``kv_state`` subject.
"""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import nats.errors

from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored, KvEventBatch, WorkerLoad
from runtime.kv.publisher import KvEventPublisher
from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.distributed.kv_pool import (
    ADDRESS,
    MODEL,
    NatsListener,
    complete,
    mocker_settings,
    registered_block_size,
    start_pool,
    start_workers,
    stored_hashes,
)

BLOCK = 16
SETTINGS = {"speedup_ratio": 1000, "block_size": BLOCK, "num_gpu_blocks": 512, "dp_size": 2}


def test_a_mocker_worker_publishes_kv_events_load_and_cache_state(cluster: Cluster, tmp_path: Path) -> None:
    prompt = list(range(1000, 1000 + 4 * BLOCK))
    with NatsListener(cluster.nats.url) as listener:
        ingress = cluster.start_ingress()
        [worker] = start_workers(cluster, 1, *mocker_settings(tmp_path, **SETTINGS))
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
    engine = mocker_settings(tmp_path, **{**SETTINGS, "dp_size": 1})
    with NatsListener(cluster.nats.url) as listener:
        # Nothing cached anywhere: the router breaks ties at random, so both workers show up.
        ingress, workers = start_pool(cluster, "--router-mode", "kv", engine_args=engine, workers=2)

        prefix = list(range(3000, 3000 + 8 * BLOCK))
        holder = complete(ingress, prefix)
        blocks = sequence_block_hashes(prefix, BLOCK)
        listener.wait_for(
            lambda seen: stored_hashes(seen.batches, int(holder, 16), 0)[:8] == blocks, 10, "no stored event"
        )
        served = [complete(ingress, [*prefix, *range(9000 + 10 * turn, 9000 + 10 * turn + 5)]) for turn in range(5)]
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
    assert "configures out=mistralrs or out=mocker or out=sglang or out=trtllm or out=vllm, not out=echo_core" in (
        result.stderr
    )


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
