"""Router replicas of one pool on a real NATS share their decisions (``--router-replica-sync``).

Each router has a NATS connection of its own, as routers in two ingress processes would.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry

from frontend_gateway.routing import replica_sync
from frontend_gateway.routing.kv_indexer import PredictedKvIndexer
from frontend_gateway.routing.kv_router import KvRouter
from frontend_gateway.routing.metrics import ModelRoutingMetrics, RoutingCollectors
from frontend_gateway.routing.protocol import InstanceInfo, RouterMode, RouterSettings
from frontend_gateway.routing.replica_sync import Finished, PrefillDone, Routed, SyncBatch, sync_subjects
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.nats_connection import connect_nats, flush
from runtime.kv.blocks import sequence_block_hashes
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from tests.frontend_gateway.routing.waiting import until
from tests.infra import NatsServer

BLOCK = 16
ADDRESS = EndpointAddress("llm", "backend", "generate")
A, B = InstanceInfo(0xA, "s.a"), InstanceInfo(0xB, "s.b")
PROMPT = list(range(1000, 1000 + 8 * BLOCK + 5))  # 8 full blocks and 5 tokens
HASHES = sequence_block_hashes(PROMPT, BLOCK)
SYNCED = RouterSettings(mode=RouterMode.KV, replica_sync=True, seed=1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(request_id: str) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=request_id,
        model="m",
        token_ids=PROMPT,
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=8),
    )


@pytest.fixture
async def make_router(nats_server: NatsServer) -> AsyncIterator[Callable[..., Any]]:
    """Routers of one pool, each on a NATS connection of its own (as in separate ingress processes)."""
    made: list[tuple[KvRouter, NATS]] = []
    connections: dict[int, NATS] = {}

    async def make(settings: RouterSettings = SYNCED, clock: Callable[[], float] | None = None) -> KvRouter:
        nc = await connect_nats(nats_server.url, name=f"ingress-{len(made)}")
        router = KvRouter(settings, block_size=BLOCK, nc=nc, address=ADDRESS, clock=clock or time.monotonic)
        made.append((router, nc))
        connections[id(router)] = nc
        await router.start()
        for instance in (A, B):
            router.instance_added(instance)
        return router

    make.connection_of = lambda router: connections[id(router)]  # type: ignore[attr-defined]
    yield make
    for router, nc in made:
        await router.close()
        if not nc.is_closed:
            await nc.close()


@pytest.fixture
async def forger(nats_server: NatsServer) -> AsyncIterator[NATS]:
    """A connection that publishes what the test writes by hand on the replicas' subjects."""
    nc = await connect_nats(nats_server.url, name="forger")
    yield nc
    await nc.close()


def hears(router: KvRouter, replicas: int) -> Callable[[], bool]:
    return lambda: router.replica_sync.replicas() == replicas


async def heard(*routers: KvRouter) -> None:
    """Wait until each router has heard every other (a replica tells its decisions once it hears others)."""
    for router in routers:
        await until(router, hears(router, len(routers) - 1))


async def send(nc: NATS, replica: str, batch: SyncBatch | bytes) -> None:
    payload = batch if isinstance(batch, bytes) else msgspec.msgpack.encode(batch)
    await nc.publish(sync_subjects(ADDRESS).removesuffix("*") + replica, payload)
    await flush(nc)


def requests_on(router: KvRouter, instance: InstanceInfo) -> int:
    return router.load.requests((instance.instance_id, 0))


async def test_a_decision_of_one_replica_loads_the_workers_of_the_other(make_router: Any) -> None:
    first, second = await make_router(), await make_router()
    await heard(first, second)
    decision = first.choose(request("r1"), [A, B])
    assert decision is not None
    chosen = decision.instance
    worker = (chosen.instance_id, 0)
    await until(second, lambda: requests_on(second, chosen) == 1)
    assert second.load.prefill_tokens(worker) == len(PROMPT)
    assert second.load.new_blocks(worker, HASHES) == 0  # the prompt's blocks are held there now
    # The same hot prompt through the second replica goes to the other worker: the first's is busy with it.
    herd = second.choose(request("r2"), [A, B])
    assert herd is not None and herd.instance != chosen
    second.finished("r2")

    first.prefill_done("r1")
    await until(second, lambda: second.load.prefill_tokens(worker) == 0)
    assert requests_on(second, chosen) == 1
    first.finished("r1")
    await until(second, lambda: requests_on(second, chosen) == 0)
    assert second.load.decode_blocks(worker) == 0
    assert second.replica_sync.remote_requests() == 0


async def test_replicas_begun_without_nats_share_decisions_through_their_caller() -> None:
    """``begin`` and ``take_batches`` carry the same messages as NATS would (bench/routing_sim.py carries
    them in simulated time); closing such a replica sends nothing."""
    routers = [
        KvRouter(SYNCED, block_size=BLOCK, nc=None, address=ADDRESS)  # type: ignore[arg-type]  # NATS is never used
        for _ in range(2)
    ]
    for router in routers:
        for instance in (A, B):
            router.instance_added(instance)
        await router.subscriber.close()  # it would listen on NATS
        router.replica_sync.begin()
    first, second = routers

    def carry(sender: KvRouter, receiver: KvRouter) -> None:
        for data in sender.replica_sync.take_batches():
            receiver.replica_sync.on_batch(data, sender.replica_sync.subject)

    carry(first, second)  # a heartbeat: the second knows the first now
    carry(second, first)
    assert first.replica_sync.replicas() == second.replica_sync.replicas() == 1
    decision = first.choose(request("r1"), [A, B])
    assert decision is not None
    carry(first, second)
    assert requests_on(second, decision.instance) == 1
    assert second.load.new_blocks((decision.instance.instance_id, 0), HASHES) == 0
    # KV events tell it which blocks the worker caches: nothing is predicted from the first's decision.
    assert second.predicted.find_matches(HASHES) == {}
    first.finished("r1")
    carry(first, second)
    assert requests_on(second, decision.instance) == 0
    assert second.replica_sync.malformed == 0
    for router in routers:
        await router.close()  # no NATS to say goodbye on: nothing is published


async def test_how_late_the_others_decisions_arrive_is_measured_in_the_routing_metrics() -> None:
    registry = CollectorRegistry()
    health = ModelRoutingMetrics(RoutingCollectors(registry), "m")
    sender = KvRouter(SYNCED, block_size=BLOCK, nc=None, address=ADDRESS)  # type: ignore[arg-type]
    receiver = KvRouter(SYNCED, block_size=BLOCK, nc=None, address=ADDRESS, health=health)  # type: ignore[arg-type]
    sender.replica_sync.begin()
    [late] = sender.replica_sync.take_batches()
    await asyncio.sleep(0.05)
    receiver.replica_sync.on_batch(late, sender.replica_sync.subject)
    # A sender whose clock runs ahead counts as no delay, never as a negative one.
    ahead = msgspec.msgpack.encode(SyncBatch(block_size=BLOCK, sent_at=time.time() + 60))
    receiver.replica_sync.on_batch(ahead, sender.replica_sync.subject)
    # One that does not say when it sent (an older version) is not counted.
    receiver.replica_sync.on_batch(msgspec.msgpack.encode(SyncBatch(block_size=BLOCK)), sender.replica_sync.subject)

    def sample(suffix: str) -> float | None:
        return registry.get_sample_value(f"flotilla_router_replica_sync_delay_seconds_{suffix}", {"model": "m"})

    assert sample("count") == 2
    total = sample("sum")
    assert total is not None and 0.05 <= total < 5
    fastest = registry.get_sample_value(
        "flotilla_router_replica_sync_delay_seconds_bucket", {"model": "m", "le": "0.0005"}
    )
    assert fastest == 1  # the one from ahead
    for router in (sender, receiver):
        await router.close()


async def test_a_replica_that_hears_no_other_sends_heartbeats_only(make_router: Any, forger: NATS) -> None:
    subscription = await forger.subscribe(sync_subjects(ADDRESS))
    await flush(forger)
    lone = await make_router()
    async with asyncio.timeout(10):
        first = await subscription.next_msg(timeout=10)  # sent as it starts
        lone.choose(request("r1"), [A, B])
        lone.prefill_done("r1")
        lone.finished("r1")
        second = await subscription.next_msg(timeout=10)  # a second later
    for message in (first, second):
        assert message.subject == lone.replica_sync.subject
        heartbeat = msgspec.msgpack.decode(message.data, type=SyncBatch)
        assert msgspec.structs.replace(heartbeat, sent_at=0.0) == SyncBatch(block_size=BLOCK)
        assert abs(heartbeat.sent_at - time.time()) < 60


async def test_a_predicting_router_learns_the_prefixes_another_replica_routed(make_router: Any) -> None:
    settings = RouterSettings(mode=RouterMode.KV, replica_sync=True, use_kv_events=False, seed=1)
    first, second = await make_router(settings), await make_router(settings)
    await heard(first, second)
    decision = first.choose(request("r1"), [A, B])
    assert decision is not None
    worker = (decision.instance.instance_id, 0)
    assert isinstance(second.indexer, PredictedKvIndexer)
    await until(second, lambda: second.indexer.find_matches(HASHES).get(worker) == len(HASHES))


async def test_decisions_too_many_for_one_message_arrive_in_several_in_order(make_router: Any) -> None:
    first, second = await make_router(), await make_router()
    await heard(first, second)
    # Long prompts: their hashes pass the size of one batch, so the decisions leave in several messages.
    count = 2 * replica_sync.HASHES_PER_BATCH // 8000 + 1
    for number in range(count):
        hashes = list(range(number * 8000, (number + 1) * 8000))
        first.replica_sync.routed(f"long{number}", (A.instance_id, 0), prefill_tokens=1, hashes=hashes, own_blocks=1)
    first.replica_sync.finished("long0")
    worker = (A.instance_id, 0)
    # Once the last decision is heard, all are (and the first one's end, sent after them, too).
    await until(second, lambda: second.load.new_blocks(worker, hashes) == 0)
    await until(second, lambda: second.replica_sync.remote_requests() == count - 1)
    assert second.load.new_blocks(worker, range(8000, count * 8000)) == 0
    assert second.load.new_blocks(worker, range(8000)) == 8000


async def test_a_replica_that_falls_silent_has_its_requests_expire(make_router: Any) -> None:
    clock = FakeClock()
    first, second = await make_router(), await make_router(clock=clock)
    await heard(first, second)
    decision = first.choose(request("r1"), [A, B])
    assert decision is not None
    await until(second, lambda: requests_on(second, decision.instance) == 1)

    # Alive, it is heard (a heartbeat a second at least) and its request stays counted past the expiry.
    clock.now += replica_sync.EXPIRE_AFTER_S - 1
    before = second.replica_sync.heard_at()
    await until(second, lambda: second.replica_sync.heard_at() != before)
    clock.now += replica_sync.EXPIRE_AFTER_S - 1
    second.replica_sync.expire_silent()
    assert requests_on(second, decision.instance) == 1

    # Its process dies (its NATS connection goes, no goodbye): after the expiry its request no longer counts.
    await make_router.connection_of(first).close()
    last_heard = max(second.replica_sync.heard_at().values())
    clock.now = last_heard + replica_sync.EXPIRE_AFTER_S - 0.5
    second.replica_sync.expire_silent()
    assert requests_on(second, decision.instance) == 1
    clock.now += replica_sync.EXPIRE_AFTER_S + 1  # no await since: nothing was heard meanwhile
    second.replica_sync.expire_silent()
    assert requests_on(second, decision.instance) == 0
    assert second.replica_sync.replicas() == 0
    assert second.replica_sync.expired_replicas == 1


async def test_a_replica_that_closes_takes_its_requests_with_it(make_router: Any) -> None:
    first, second = await make_router(), await make_router()
    await heard(first, second)
    decision = first.choose(request("r1"), [A, B])
    assert decision is not None
    await until(second, lambda: requests_on(second, decision.instance) == 1)
    await first.close()
    await until(second, lambda: requests_on(second, decision.instance) == 0)
    assert second.replica_sync.replicas() == 0


async def test_the_requests_missing_from_a_replicas_list_are_dropped(make_router: Any, forger: NATS) -> None:
    router = await make_router()
    routed = [Routed(name, A.instance_id, 0, 100, 1, HASHES) for name in ("kept", "lost")]
    await send(forger, "abc1", SyncBatch(block_size=BLOCK, events=list(routed)))
    await until(router, lambda: requests_on(router, A) == 2)
    # Its Finished("lost") never arrived; its next list of requests in flight says "kept" only.
    await send(forger, "abc1", SyncBatch(block_size=BLOCK, active=["kept"]))
    await until(router, lambda: requests_on(router, A) == 1)


async def test_a_replica_is_believed_about_its_own_requests_only(make_router: Any, forger: NATS) -> None:
    first, second = await make_router(), await make_router()
    await heard(first, second)
    decision = first.choose(request("r1"), [A, B])
    assert decision is not None
    await until(second, lambda: requests_on(second, decision.instance) == 1)
    second.choose(request("mine"), [A, B])
    in_flight = second.load.in_flight()
    # Another replica says the same request ids ended: they are not its own, so nothing changes.
    await send(forger, "f00d", SyncBatch(block_size=BLOCK, events=[Finished("r1"), Finished("mine")]))
    await send(forger, "f00d", SyncBatch(block_size=BLOCK, events=[PrefillDone("r1")]))
    await until(second, lambda: second.replica_sync.replicas() == 2)
    assert second.load.in_flight() == in_flight
    # Nor is a decision about an instance outside the pool kept.
    await send(forger, "f00d", SyncBatch(block_size=BLOCK, events=[Routed("x", 0xC, 0, 10, 1, [])]))
    await send(forger, "f00d", SyncBatch(block_size=BLOCK, events=[Routed("y", A.instance_id, 0, 10, 1, [])]))
    await until(second, lambda: second.load.in_flight() == in_flight + 1)
    assert second.load.requests((0xC, 0)) == 0


async def test_a_malformed_sync_message_is_counted_and_ignored(make_router: Any, forger: NATS) -> None:
    router = await make_router()
    too_many_hashes = list(range(replica_sync.MAX_HASHES + 1))
    malformed: list[tuple[str, SyncBatch | bytes]] = [
        ("abc2", b"\x93not msgpack of a batch"),
        ("abc2", msgspec.msgpack.encode({"block_size": BLOCK, "events": [["r", "a", -1, 0, 0, 0, []]]})),
        ("abc2", SyncBatch(block_size=BLOCK, events=[Routed("big", A.instance_id, 0, 1, 1, too_many_hashes)])),
        ("abc2", SyncBatch(block_size=BLOCK * 2, events=[Routed("other", A.instance_id, 0, 1, 1, [])])),
        ("NOT-A-REPLICA", SyncBatch(block_size=BLOCK, events=[Routed("bad", A.instance_id, 0, 1, 1, [])])),
    ]
    for replica, batch in malformed:
        await send(forger, replica, batch)
    await until(router, lambda: router.replica_sync.malformed == len(malformed))
    assert router.load.in_flight() == 0
    # The router goes on hearing and routing.
    await send(forger, "abc2", SyncBatch(block_size=BLOCK, events=[Routed("ok", A.instance_id, 0, 1, 1, [])]))
    await until(router, lambda: requests_on(router, A) == 1)
    assert router.choose(request("r"), [A, B]) is not None


async def test_ends_wait_for_a_decision_to_ride_with_and_go_alone_when_none_comes() -> None:
    """A prefill done or an end costs every replica a message of its own only when no decision follows it
    within ``ends_wait_s``: ``ends_due`` says when the sender must send them."""
    clock = FakeClock()
    router = KvRouter(SYNCED, block_size=BLOCK, nc=None, address=ADDRESS, clock=clock)  # type: ignore[arg-type]
    peer = KvRouter(SYNCED, block_size=BLOCK, nc=None, address=ADDRESS)  # type: ignore[arg-type]
    for each in (router, peer):
        for instance in (A, B):
            each.instance_added(instance)
        await each.subscriber.close()
        each.replica_sync.begin()
    sync = router.replica_sync
    [hello] = peer.replica_sync.take_batches()
    sync.on_batch(hello, peer.replica_sync.subject)  # it has someone to tell now
    sync.take_batches()
    assert sync.ends_due() is None  # nothing waits

    assert router.choose(request("r1"), [A, B]) is not None
    assert sync.ends_due() is None  # a decision goes as soon as the sender runs: nothing to time
    sync.take_batches()
    router.prefill_done("r1")
    assert sync.ends_due() == clock.now + replica_sync.ENDS_WAIT_S
    clock.now += 0.01
    router.finished("r1")
    assert sync.ends_due() == clock.now - 0.01 + replica_sync.ENDS_WAIT_S  # the first end sets the time
    [ends] = sync.take_batches()
    assert [type(event) for event in msgspec.msgpack.decode(ends, type=SyncBatch).events] == [PrefillDone, Finished]
    assert sync.ends_due() is None

    # Ends said just before a decision leave with it, in the order said.
    assert router.choose(request("r2"), [A, B]) is not None
    sync.take_batches()
    router.prefill_done("r2")
    assert router.choose(request("r3"), [A, B]) is not None
    assert sync.ends_due() is None
    [both] = sync.take_batches()
    batch = msgspec.msgpack.decode(both, type=SyncBatch)
    assert [(type(event), event.request_id) for event in batch.events] == [(PrefillDone, "r2"), (Routed, "r3")]
    peer.replica_sync.on_batch(both, sync.subject)
    assert peer.replica_sync.remote_requests() == 1  # r3 (r2 was routed before the peer heard the batch)
    for each in (router, peer):
        await each.close()


async def test_over_nats_an_end_alone_is_sent_after_its_wait_not_at_the_heartbeat(
    make_router: Any, forger: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = await make_router(), await make_router()
    await heard(first, second)
    first.replica_sync.ends_wait_s = 0.2
    subscription = await forger.subscribe(first.replica_sync.subject)
    await flush(forger)
    monkeypatch.setattr(replica_sync, "HEARTBEAT_S", 60.0)
    monkeypatch.setattr(replica_sync, "EXPIRE_AFTER_S", 600.0)
    await subscription.next_msg(timeout=10)  # the heartbeat due before the patch: the next is a minute away
    decision = first.choose(request("r1"), [A, B])
    assert decision is not None

    async def next_events() -> list[type]:
        message = await subscription.next_msg(timeout=30)  # well before the next heartbeat
        return [type(event) for event in msgspec.msgpack.decode(message.data, type=SyncBatch).events]

    assert await next_events() == [Routed]
    first.prefill_done("r1")
    first.finished("r1")
    assert await next_events() == [PrefillDone, Finished]
    await until(second, lambda: requests_on(second, decision.instance) == 0)
