"""KV-aware routing end to end: an ingress in ``--router-mode kv`` over 4 mocker workers, real etcd and NATS.

The workers are real ``flotilla run in=dyn://llm out=mocker`` processes: their KV events, load reports
and answers to cache-state asks are the ones their simulated caches produce; the test publishes
nothing. Which worker served a request is the ingress's ``x-flotilla-instance`` header; that its cache
was hit is the worker's own ``usage.prompt_tokens_details.cached_tokens``. The test waits for a
worker's stored event on NATS (a ``NatsListener``) before it relies on the router knowing the block:
the ingress hears the same message at the same moment, and reads it before an HTTP request that
is sent only afterwards reaches its router.

Each routing assertion sends several requests that a round-robin or random router would scatter,
so each test fails without KV routing; and each that routes by events fails at its first wait
when the workers publish none. A hang fails within the module's 90 s per test.
"""

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime.cluster.discovery import INSTANCES_PREFIX, instance_key
from runtime.kv.blocks import sequence_block_hashes
from tests.distributed.cluster import Cluster, Worker, etcd_leases, wait_until
from tests.distributed.kv_pool import (
    ADDRESS,
    Completion,
    NatsListener,
    complete,
    fresh_prefix,
    mocker_settings,
    registered_block_size,
    send,
    start_pool,
    start_workers,
    unique_tokens,
    wait_for_every_worker,
)
from tests.infra import EtcdServer, NatsServer
from tests.servers import Server

pytestmark = pytest.mark.timeout(90)

BLOCK = 16
#: A prefix of 16 full blocks (256 tokens); a request adds a 5-token tail of its own.
PREFIX_BLOCKS = 16
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK
WORKERS = 4
# Speed-up 2: a short request takes ~15 ms of simulated time, and 400 output tokens over a second,
# long enough for a burst of requests to overlap on this machine. 4096 blocks per worker: nothing a test
# caches is evicted during the module.
SETTINGS = {"speedup_ratio": 2, "block_size": BLOCK, "num_gpu_blocks": 4096}


@dataclass
class MockerPool:
    """Four mocker workers on their own etcd and NATS, shared by the tests that kill none of them."""

    cluster: Cluster
    workers: list[Worker]

    def start_ingress(self, *args: str) -> Server:
        """An ingress with ``args`` that routes to every worker of the pool."""
        ingress = self.cluster.start_ingress(*args)
        wait_for_every_worker(ingress, self.workers)
        return ingress


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockerPool]:
    # Starting 4 workers takes ~6 s here: once for the module. Every test uses prefixes of its own
    # (fresh_prefix), so what one test cached cannot draw another's requests.
    directory = tmp_path_factory.mktemp("kv_mocker")
    etcd, nats = EtcdServer(directory / "etcd"), NatsServer(directory / "nats")
    etcd.start()
    nats.start()
    cluster = Cluster(etcd, nats, directory)
    try:
        workers = start_workers(cluster, WORKERS, *mocker_settings(directory, **SETTINGS))
        assert registered_block_size(etcd) == BLOCK
        yield MockerPool(cluster, workers)
    finally:
        cluster.stop()
        nats.stop()
        etcd.stop()


def warm(ingress: Server, listener: NatsListener) -> tuple[str, list[int]]:
    """Cache a fresh prefix on whichever worker the ingress picks; returns that worker and the prefix.

    Returns once the worker has published the prefix's blocks (so the ingress knows them too).
    """
    prefix = fresh_prefix(PREFIX_BLOCKS, BLOCK)
    first = send(ingress, [*prefix, *unique_tokens(5)])
    assert first.cached_tokens == 0, "a fresh prefix was already cached"
    listener.wait_for_stored(first.instance, sequence_block_hashes(prefix, BLOCK))
    return first.instance, prefix


def warm_on_every_worker(ingress: Server, listener: NatsListener) -> dict[str, list[int]]:
    """A fresh prefix cached on each worker of the pool: {worker: its prefix}.

    With nothing of a fresh prefix cached anywhere and every worker idle, the KV router breaks the
    tie at random; prefixes that land on a worker that already has one are cached but not used. 80
    tries miss one of 4 workers with probability 4 × (3/4)^80, about 4e-10.
    """
    holders: dict[str, list[int]] = {}
    for _ in range(80):
        holder, prefix = warm(ingress, listener)
        holders.setdefault(holder, prefix)
        if len(holders) == WORKERS:
            return holders
    raise AssertionError(f"fresh prefixes landed on only {sorted(holders)}")


def test_requests_sharing_a_long_prefix_land_on_the_mocker_that_cached_it(pool: MockerPool) -> None:
    ingress = pool.start_ingress("--router-mode", "kv")
    with NatsListener(pool.cluster.nats.url) as listener:
        holders = warm_on_every_worker(ingress, listener)
    assert set(holders) == {worker.instance_id for worker in pool.workers}
    # Each prefix three times running, then the prefixes in turn the other way round (not in the
    # order they were warmed, which a round-robin router would follow): each request lands on its
    # prefix's holder and finds the 16 blocks there.
    order = [holder for holder in holders for _ in range(3)] + [*reversed(holders)] * 2
    for holder in order:
        assert send(ingress, [*holders[holder], *unique_tokens(5)]) == Completion(holder, PREFIX_TOKENS)
    ingress.stop()


def test_load_still_spreads_over_the_mockers_when_every_request_shares_one_prefix(pool: MockerPool) -> None:
    ingress = pool.start_ingress("--router-mode", "kv")
    with NatsListener(pool.cluster.nats.url) as listener:
        holder, prefix = warm(ingress, listener)
    # One at a time, requests go to the holder: idle, it costs 16 blocks of prefill less than any other.
    assert [complete(ingress, [*prefix, *unique_tokens(5)]) for _ in range(4)] == [holder] * 4

    def timed(tail: list[int]) -> tuple[float, float, str]:
        sent = time.monotonic()
        instance = complete(ingress, [*prefix, *tail], max_tokens=400)
        return sent, time.monotonic(), instance

    # 16 at once, each 400 tokens long (~2 s here): routed within a few tenths of a second, they overlap.
    with ThreadPoolExecutor(16) as threads:
        burst = list(threads.map(timed, [unique_tokens(5) for _ in range(16)]))
    # A precondition rather than the property: had the first come back before the last was sent, the
    # router would have seen fewer at once than the bound below assumes.
    last_sent, first_back = max(sent for sent, _, _ in burst), min(done for _, done, _ in burst)
    assert last_sent < first_back, f"the burst did not overlap: the last was sent {last_sent - first_back:.2f} s late"
    served = Counter(instance for _, _, instance in burst)
    # Even, each worker gets 4. The router keeps workers within about one request of each other: a
    # running request adds its 17 prompt blocks to its worker's cost, more than the 16 blocks of
    # prefill the holder saves (and a worker that has computed the prefix holds it too). But a load
    # report landing mid-burst (once a second per worker) replaces the router's count with the
    # worker's, which counts the shared prefix once and misses requests still on their way there, so
    # that worker can look two or three requests lighter for a moment. Seen here: 4-4-4-4, 5-4-4-3,
    # now and then 6-4-3-3. Bound: half the burst, 8; a router blind to load sends all 16 to the holder.
    assert set(served) == {worker.instance_id for worker in pool.workers}, served
    assert max(served.values()) <= 8, served
    ingress.stop()


def test_a_restarted_ingress_routes_by_the_cache_state_the_mockers_send_it(pool: MockerPool) -> None:
    first = pool.start_ingress("--router-mode", "kv")
    with NatsListener(pool.cluster.nats.url) as listener:
        holders = warm_on_every_worker(first, listener)
    first.stop()

    with NatsListener(pool.cluster.nats.url, watch_state_asks=True) as spy:
        second = pool.cluster.start_ingress("--router-mode", "kv")
        # The new ingress heard none of the events above: it asks each worker for its whole cache.
        wanted = {int(worker.instance_id, 16) for worker in pool.workers}
        spy.wait_for(lambda seen: seen.answered_state_asks() >= wanted, 15, "a worker's cache state was not asked")
    for holder in [*reversed(holders), *holders]:
        assert send(second, [*holders[holder], *unique_tokens(5)]) == Completion(holder, PREFIX_TOKENS)
    second.stop()


def test_without_kv_events_the_router_sends_a_repeated_prefix_where_it_sent_it_before(pool: MockerPool) -> None:
    ingress = pool.start_ingress("--router-mode", "kv", "--use-kv-events", "false")
    prefix = fresh_prefix(PREFIX_BLOCKS, BLOCK)
    first = send(ingress, [*prefix, *unique_tokens(5)])
    assert first.cached_tokens == 0
    # Nothing waited for: the router recorded at its decision that the first worker now holds the
    # prefix, and the worker's cache agrees.
    expected = [Completion(first.instance, PREFIX_TOKENS)] * 10
    assert [send(ingress, [*prefix, *unique_tokens(5)]) for _ in range(10)] == expected
    ingress.stop()


def test_a_killed_mocker_takes_its_blocks_with_it_and_its_prefix_moves_to_a_survivor(
    cluster: Cluster, tmp_path: Path
) -> None:
    # A pool of its own: this test kills one of its workers.
    engine = mocker_settings(tmp_path, **SETTINGS)
    ingress, workers = start_pool(cluster, "--router-mode", "kv", engine_args=engine, workers=WORKERS)
    with NatsListener(cluster.nats.url) as listener:
        holder, prefix = warm(ingress, listener)
        assert send(ingress, [*prefix, *unique_tokens(5)]) == Completion(holder, PREFIX_TOKENS)
        victim = next(worker for worker in workers if worker.instance_id == holder)
        victim.kill()

        # At once, before its lease runs out: the request still succeeds, on a survivor that has to
        # compute the whole prefix again.
        moved = send(ingress, [*prefix, *unique_tokens(5)])
        assert moved.instance != holder and moved.cached_tokens == 0, moved
        listener.wait_for_stored(moved.instance, sequence_block_hashes(prefix, BLOCK))
        assert send(ingress, [*prefix, *unique_tokens(5)]) == Completion(moved.instance, PREFIX_TOKENS)

    # Once the dead worker's lease has expired and the ingress dropped it, the survivor keeps the prefix.
    dead_key = instance_key(ADDRESS, int(holder, 16))
    wait_until(lambda: dead_key not in etcd_leases(cluster.etcd, INSTANCES_PREFIX), 15, "the dead worker stayed")
    expected = [Completion(moved.instance, PREFIX_TOKENS)] * 5
    assert [send(ingress, [*prefix, *unique_tokens(5)]) for _ in range(5)] == expected
