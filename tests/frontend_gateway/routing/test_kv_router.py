"""The KV router on a real NATS: KV events and load reports published by the test on workers' behalf."""

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from frontend_gateway.routing import kv_subscriber
from frontend_gateway.routing.kv_indexer import KvIndexer
from frontend_gateway.routing.kv_router import KvRouter
from frontend_gateway.routing.protocol import Decision, InstanceInfo, RouterMode, RouterSettings
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.nats_connection import connect_nats, flush
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, KvStateRequest, WorkerLoad
from runtime.protocol import ImageInput, PreprocessedRequest, SamplingOptions, StopConditions
from tests.frontend_gateway.routing.waiting import QUICK_STATE_RETRIES, until
from tests.infra import NatsServer

BLOCK = 16
ADDRESS = EndpointAddress("llm", "backend", "generate")
A, B = InstanceInfo(0xA, "s.a"), InstanceInfo(0xB, "s.b")
PROMPT = list(range(1000, 1000 + 8 * BLOCK + 5))  # 8 full blocks and 5 tokens
HASHES = sequence_block_hashes(PROMPT, BLOCK)
KV = RouterSettings(mode=RouterMode.KV, seed=1)


def request(tokens: list[int], request_id: str = "r", max_tokens: int = 8) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=request_id,
        model="m",
        token_ids=tokens,
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=max_tokens),
    )


@pytest.fixture(autouse=True)
def _quick_state_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_subscriber, "STATE_RETRY_DELAYS_S", QUICK_STATE_RETRIES)


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    connection = await connect_nats(nats_server.url, name="kv-router-test")
    yield connection
    await connection.close()


@pytest.fixture
async def publisher(nats_server: NatsServer) -> AsyncIterator[NATS]:
    """The workers' side: a connection of its own, as a worker process would have."""
    connection = await connect_nats(nats_server.url, name="kv-router-test-workers")
    yield connection
    await connection.close()


@pytest.fixture
async def make_router(nc: NATS) -> AsyncIterator[Callable[..., Any]]:
    routers: list[KvRouter] = []

    async def make(settings: RouterSettings = KV, instances: tuple[InstanceInfo, ...] = (A, B)) -> KvRouter:
        router = KvRouter(settings, block_size=BLOCK, nc=nc, address=ADDRESS)
        routers.append(router)
        await router.start()
        for instance in instances:
            router.instance_added(instance)
        return router

    yield make
    for router in routers:
        await router.close()


async def publish(nc: NATS, instance: InstanceInfo, event_id: int, *events: KvEvent, dp_rank: int = 0) -> None:
    batch = KvEventBatch(instance_id=instance.instance_id, dp_rank=dp_rank, event_id=event_id, events=list(events))
    await nc.publish(ADDRESS.kv_events_subject(), msgspec.msgpack.encode(batch))
    await flush(nc)


def blocks_of(router: KvRouter, instance: InstanceInfo, dp_rank: int = 0) -> int:
    assert isinstance(router.indexer, KvIndexer)
    return router.indexer.block_count((instance.instance_id, dp_rank))


def choose(router: KvRouter, tokens: list[int] = PROMPT, request_id: str = "r", max_tokens: int = 8) -> Decision:
    decision = router.choose(request(tokens, request_id, max_tokens), [A, B])
    assert decision is not None
    return decision


async def test_a_request_goes_to_the_worker_holding_its_prefix(make_router: Any, publisher: NATS) -> None:
    router = await make_router()
    await publish(publisher, B, 1, BlockStored(HASHES[:6]))
    await until(router, lambda: blocks_of(router, B) == 6)
    decision = choose(router)
    assert decision == Decision(B, dp_rank=0, overlap_blocks=6, prefill_tokens=len(PROMPT) - 6 * BLOCK)
    router.finished("r")
    # Another prompt that shares the first 3 blocks only still prefers B.
    other = [*PROMPT[: 3 * BLOCK], *range(5000, 5000 + 5 * BLOCK)]
    assert choose(router, other).overlap_blocks == 3


async def test_load_still_spreads_when_every_request_shares_one_prefix(make_router: Any, publisher: NATS) -> None:
    router = await make_router()
    await publish(publisher, A, 1, BlockStored(HASHES))
    await until(router, lambda: blocks_of(router, A) == 8)
    # None of them finishes, nor its prefill. Running requests share the 8 prompt blocks on a worker, but
    # each answer of 128 tokens fills 9 blocks of its own (5 + 128 tokens in blocks of 16), more than the
    # 8 blocks of prefill A's cache saves: by hand, A B A A B A A B (a prompt still in flight to B, 133
    # tokens uncached, weighs there until its prefill is done).
    served = Counter(choose(router, request_id=f"r{n}", max_tokens=128).instance for n in range(8))
    assert served[A] >= served[B] > 0
    assert served[A] <= 5


async def test_identical_short_requests_share_their_blocks_on_the_holder(make_router: Any, publisher: NATS) -> None:
    router = await make_router()
    await publish(publisher, A, 1, BlockStored(HASHES))
    await until(router, lambda: blocks_of(router, A) == 8)
    # Answers of 8 tokens: each request's own blocks are 1 (5 + 8 tokens); its 8 prompt blocks are
    # shared with the others on A. A costs 5/16 prefill blocks per request in flight + 8 shared + 1 each;
    # B costs 133/16 prefill + 9: A takes requests until it runs 7, as a worker that holds the prompt
    # once would. (Without counting shared blocks once, B would get every second one.)
    served = [choose(router, request_id=f"r{n}").instance for n in range(8)]
    assert served[:7] == [A] * 7


async def test_finished_requests_stop_loading_their_worker(make_router: Any, publisher: NATS) -> None:
    router = await make_router()
    await publish(publisher, A, 1, BlockStored(HASHES))
    await until(router, lambda: blocks_of(router, A) == 8)
    for n in range(6):
        assert choose(router, request_id=f"r{n}").instance == A
        router.prefill_done(f"r{n}")
        router.finished(f"r{n}")
    assert router.load.in_flight() == 0


async def test_a_joining_instance_is_asked_for_its_whole_cache(make_router: Any, publisher: NATS) -> None:
    asked: list[KvStateRequest] = []

    async def answer(message: Msg) -> None:
        asked.append(msgspec.msgpack.decode(message.data, type=KvStateRequest))
        state = KvEventBatch(instance_id=B.instance_id, event_id=0, events=[BlockStored(HASHES[:7])])
        await message.respond(msgspec.msgpack.encode(state))

    await publisher.subscribe(ADDRESS.kv_state_subject(B.instance_id), cb=answer)
    await flush(publisher)
    router = await make_router(instances=(A,))
    router.instance_added(B)
    await until(router, lambda: blocks_of(router, B) == 7)
    assert [ask.dp_rank for ask in asked] == [0]
    assert choose(router).instance == B


async def test_a_gap_in_event_ids_makes_the_router_ask_for_the_whole_state(make_router: Any, publisher: NATS) -> None:
    answers = [BlockStored(HASHES[:2])]  # what B really holds once asked (a lost batch removed the rest)

    async def answer(message: Msg) -> None:
        state = KvEventBatch(instance_id=B.instance_id, event_id=0, events=list(answers))
        await message.respond(msgspec.msgpack.encode(state))

    router = await make_router(instances=(A,))  # B joins later: the first ask is answered too
    await publisher.subscribe(ADDRESS.kv_state_subject(B.instance_id), cb=answer)
    await flush(publisher)
    router.instance_added(B)
    await until(router, lambda: router.state_syncs == 1)
    await publish(publisher, B, 1, BlockStored(HASHES))
    await until(router, lambda: blocks_of(router, B) == 8)
    await publish(publisher, B, 3, BlockStored([1, 2, 3]))  # batch 2 was lost
    await until(router, lambda: router.state_syncs == 2)
    assert router.gaps == 1
    assert blocks_of(router, B) == 2
    # The batch after a whole-state answer continues from it, whatever its id.
    await publish(publisher, B, 4, BlockStored(HASHES[2:4], parent_hash=HASHES[1]))
    await until(router, lambda: blocks_of(router, B) == 4)
    assert router.gaps == 1


async def test_duplicate_and_late_batches_are_ignored(make_router: Any, publisher: NATS) -> None:
    router = await make_router()
    await publish(publisher, A, 1, BlockStored(HASHES))
    await publish(publisher, A, 2, BlockRemoved(HASHES[4:]))
    await until(router, lambda: blocks_of(router, A) == 4)
    await publish(publisher, A, 2, BlockRemoved(HASHES[2:]))  # a duplicate of batch 2
    await publish(publisher, A, 1, AllCleared())  # a late copy of an older batch
    await until(router, lambda: router.stale_batches == 2)
    assert blocks_of(router, A) == 4
    assert router.gaps == 0


async def test_malformed_messages_are_reported_and_change_nothing(
    make_router: Any, publisher: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    router = await make_router()
    bad = [
        b"\xc1 not msgpack",
        msgspec.msgpack.encode({"instance_id": "ten", "event_id": 1, "events": []}),
        msgspec.msgpack.encode({"instance_id": A.instance_id, "event_id": 1, "events": [["stored", "x"]]}),
        msgspec.msgpack.encode({"instance_id": A.instance_id, "event_id": -4, "events": []}),
    ]
    with caplog.at_level(logging.WARNING, logger="frontend_gateway.routing.kv_subscriber"):
        for data in bad:
            await publisher.publish(ADDRESS.kv_events_subject(), data)
        await publisher.publish(ADDRESS.load_metrics_subject(), b"{not json")
        await publish(publisher, A, 1, BlockStored(HASHES[:3]))
        await until(router, lambda: blocks_of(router, A) == 3)
    assert router.subscriber.malformed == 5
    assert "the KV router ignored a malformed KV event batch" in caplog.text
    assert choose(router).overlap_blocks == 3


async def test_an_instance_that_leaves_takes_its_blocks_and_its_late_events_are_ignored(
    make_router: Any, publisher: NATS
) -> None:
    router = await make_router()
    await publish(publisher, B, 1, BlockStored(HASHES))
    await until(router, lambda: blocks_of(router, B) == 8)
    router.instance_removed(B.instance_id)
    assert blocks_of(router, B) == 0
    await publish(publisher, B, 2, BlockStored(HASHES))
    await publish(publisher, A, 1, BlockStored(HASHES[:1]))
    await until(router, lambda: blocks_of(router, A) == 1)
    assert blocks_of(router, B) == 0


async def test_a_workers_load_report_steers_requests_away_from_it(make_router: Any, publisher: NATS) -> None:
    router = await make_router()
    await publish(publisher, A, 1, BlockStored(HASHES))
    await until(router, lambda: blocks_of(router, A) == 8)
    # Other ingresses keep A busy: 500 active blocks outweigh an 8-block cache hit.
    report = WorkerLoad(instance_id=A.instance_id, active_requests=40, kv_active_blocks=500)
    await publisher.publish(ADDRESS.load_metrics_subject(), msgspec.json.encode(report))
    await until(router, lambda: router.load.decode_blocks((A.instance_id, 0)) == 500)
    assert choose(router).instance == B


async def test_a_dp_rank_seen_in_reports_becomes_a_candidate(make_router: Any, publisher: NATS) -> None:
    router = await make_router()
    report = WorkerLoad(instance_id=A.instance_id, dp_rank=1, active_requests=0, kv_active_blocks=0)
    await publisher.publish(ADDRESS.load_metrics_subject(), msgspec.json.encode(report))
    await publish(publisher, A, 1, BlockStored(HASHES), dp_rank=1)
    await until(router, lambda: blocks_of(router, A, dp_rank=1) == 8)
    decision = choose(router)
    assert (decision.instance, decision.dp_rank, decision.overlap_blocks) == (A, 1, 8)


async def test_without_kv_events_the_router_follows_its_own_decisions(make_router: Any, publisher: NATS) -> None:
    router = await make_router(RouterSettings(mode=RouterMode.KV, use_kv_events=False, seed=3))
    first = choose(router, request_id="first")
    router.finished("first")
    for n in range(5):
        decision = choose(router, [*PROMPT, n], request_id=f"r{n}")
        router.finished(f"r{n}")
        assert (decision.instance, decision.overlap_blocks) == (first.instance, 8)
    # Events are not listened to in this mode: one published before a load report is never heard.
    other = B if first.instance == A else A
    router.changed.clear()
    await publish(publisher, other, 1, BlockStored(HASHES))
    report = WorkerLoad(instance_id=other.instance_id, active_requests=0)
    await publisher.publish(ADDRESS.load_metrics_subject(), msgspec.json.encode(report))
    async with asyncio.timeout(10):
        await router.changed.wait()
    assert router.indexer.find_matches(HASHES) == {(first.instance.instance_id, 0): 8}


async def test_a_subscription_that_fails_is_logged_and_made_again(
    make_router: Any, nc: NATS, publisher: NATS, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    subscribe = nc.subscribe
    failures = 0

    async def failing_once(subject: str, *args: Any, **kwargs: Any) -> Any:
        nonlocal failures
        if subject == ADDRESS.kv_events_subject() and failures == 0:
            failures += 1
            raise OSError("the connection hiccuped")
        return await subscribe(subject, *args, **kwargs)

    monkeypatch.setattr(nc, "subscribe", failing_once)
    with caplog.at_level(logging.ERROR, logger="runtime.supervision"):
        router = await make_router()
    assert "failed; restarting it" in caplog.text
    assert "KV events" in caplog.text
    await publish(publisher, A, 1, BlockStored(HASHES[:5]))
    await until(router, lambda: blocks_of(router, A) == 5)


async def test_a_closed_router_stops_listening_and_asking(make_router: Any, nc: NATS, publisher: NATS) -> None:
    closed = await make_router()  # A and B answer no kv_state: their asks are being retried now
    assert closed.subscriber.asking
    await closed.close()
    assert not closed.subscriber.asking
    witness = await make_router()
    await publish(publisher, A, 1, BlockStored(HASHES))
    await until(witness, lambda: blocks_of(witness, A) == 8)
    assert blocks_of(closed, A) == 0


async def test_an_instance_is_busy_only_once_every_dp_rank_is_past_a_threshold(
    make_router: Any, publisher: NATS
) -> None:
    router = await make_router(RouterSettings(mode=RouterMode.KV, busy_waiting=2))
    for rank, waiting in ((0, 5), (1, 0)):
        report = WorkerLoad(instance_id=A.instance_id, dp_rank=rank, active_requests=waiting, waiting=waiting)
        await publisher.publish(ADDRESS.load_metrics_subject(), msgspec.json.encode(report))
    await flush(publisher)
    await until(router, lambda: router.subscriber.ranks.get(A.instance_id) == (0, 1))
    assert not router.busy(A.instance_id)  # rank 1 has room
    report = WorkerLoad(instance_id=A.instance_id, dp_rank=1, active_requests=2, waiting=2)
    await publisher.publish(ADDRESS.load_metrics_subject(), msgspec.json.encode(report))
    await flush(publisher)
    await until(router, lambda: router.busy(A.instance_id))
    assert not router.busy(B.instance_id)
    assert not (await make_router()).busy(A.instance_id)  # no thresholds: never busy


async def test_an_ask_for_a_cache_that_dies_is_logged_and_made_again(
    make_router: Any, publisher: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    asked = 0

    async def answer(message: Msg) -> None:
        nonlocal asked
        asked += 1
        state = KvEventBatch(instance_id=B.instance_id, event_id=0, events=[BlockStored(HASHES[:6])])
        await message.respond(msgspec.msgpack.encode(state))

    await publisher.subscribe(ADDRESS.kv_state_subject(B.instance_id), cb=answer)
    await flush(publisher)
    router = await make_router(instances=(A,))
    apply_state = router.subscriber._apply_state
    deaths = 0

    def dying_once(worker: Any, batch: KvEventBatch) -> None:
        nonlocal deaths
        if deaths == 0:
            deaths += 1
            raise RuntimeError("a bug while applying the answer")
        apply_state(worker, batch)

    router.subscriber._apply_state = dying_once
    with caplog.at_level(logging.ERROR, logger="runtime.supervision"):
        router.instance_added(B)
        await until(router, lambda: blocks_of(router, B) == 6)
    assert (deaths, asked) == (1, 2)
    assert "background task 'KV state of b rank 0' failed; restarting it" in caplog.text
    assert "a bug while applying the answer" in caplog.text


async def test_a_prefix_in_host_memory_draws_a_request_before_a_bare_worker_but_after_a_device_hit(
    make_router: Any, publisher: NATS
) -> None:
    router = await make_router()
    await publish(publisher, A, 1, BlockStored(HASHES[:6], medium="cpu"))  # offloaded by A
    await until(router, lambda: router.indexer.block_count((A.instance_id, 0), "cpu") == 6)
    # A saves 0.75 × 6 blocks: 72 of the prompt's tokens (133 − 72 = 61 to compute); B holds nothing.
    assert choose(router) == Decision(A, dp_rank=0, overlap_blocks=0, prefill_tokens=len(PROMPT) - 72)
    router.finished("r")
    await publish(publisher, B, 1, BlockStored(HASHES[:6]))  # the same prefix on B's device wins
    await until(router, lambda: blocks_of(router, B) == 6)
    assert choose(router).instance == B


async def test_without_kv_events_a_request_with_an_image_follows_that_image_not_another(
    make_router: Any, publisher: NATS
) -> None:
    """llama.cpp's workers publish no KV events: the router predicts their caches from its own decisions, naming the
    blocks that hold an image by the image (runtime/kv/image_blocks.py), so the same text with another image
    matches only the blocks before the image."""
    router = await make_router(RouterSettings(mode=RouterMode.KV, use_kv_events=False, seed=3))
    at = 3 * BLOCK + 2  # the image's placeholder, in the fourth block

    def with_image(digest: str, request_id: str) -> PreprocessedRequest:
        tokens = [*PROMPT[:at], 99_999, *PROMPT[at:]]
        image = ImageInput(data=b"", digest=digest, position=at, tokens=2 * BLOCK)
        return msgspec.structs.replace(request(tokens, request_id), images=[image])

    first = router.choose(with_image("aa" * 32, "red"), [A, B])
    assert first is not None
    router.finished("red")
    again = router.choose(with_image("aa" * 32, "red-again"), [A, B])
    router.finished("red-again")
    other = router.choose(with_image("bb" * 32, "blue"), [A, B])
    assert again is not None and other is not None
    # The whole widened prompt (133 tokens and the image's 32: 10 full blocks) is where the red image went.
    assert (again.instance, again.overlap_blocks) == (first.instance, 10)
    # Blue's blocks are named by blue from the fourth block on: only the three before it are a hit anywhere.
    assert other.overlap_blocks <= 3
