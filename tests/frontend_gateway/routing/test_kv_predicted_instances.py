"""A pool routed on KV events where some instances' engines publish none (their registrations say so):
their caches are predicted from the router's own decisions, beside the others' real ones, and they are
never asked for a cache state they cannot give. Real NATS."""

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from frontend_gateway.routing.kv_router import KvRouter
from frontend_gateway.routing.protocol import InstanceInfo, RouterMode, RouterSettings
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.nats_connection import connect_nats, flush
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from tests.infra import NatsServer

BLOCK = 16
ADDRESS = EndpointAddress("llm", "backend", "generate")
SILENT = InstanceInfo(0xA, "s.a", kv_events=False)  # llama.cpp, say
TALKING = InstanceInfo(0xB, "s.b")  # the mocker, say
PROMPT = list(range(1000, 1000 + 8 * BLOCK))


def request(request_id: str, tokens: list[int] = PROMPT) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=request_id,
        model="m",
        token_ids=tokens,
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=8),
    )


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    connection = await connect_nats(nats_server.url, name="kv-router-test")
    yield connection
    await connection.close()


async def test_an_instance_without_events_is_routed_on_its_predicted_cache(nc: NATS) -> None:
    asked: list[str] = []

    async def answer(message: Msg) -> None:
        asked.append(message.subject)

    await nc.subscribe(ADDRESS.kv_state_subject(SILENT.instance_id), cb=answer)
    await flush(nc)
    router = KvRouter(RouterSettings(mode=RouterMode.KV, seed=1), block_size=BLOCK, nc=nc, address=ADDRESS)
    await router.start()
    try:
        router.instance_added(SILENT)
        router.instance_added(TALKING)
        first = router.choose(request("r1"), [SILENT])  # the only candidate: the router now assumes its blocks
        assert first is not None and first.overlap_blocks == 0
        router.finished("r1")
        again = router.choose(request("r2"), [SILENT, TALKING])
        assert again is not None
        assert (again.instance, again.overlap_blocks) == (SILENT, 8)  # not a coin toss on load alone
        router.finished("r2")
        # Another prompt, nobody's: no prediction makes it match anywhere.
        other = router.choose(request("r3", list(range(5000, 5000 + 8 * BLOCK))), [SILENT, TALKING])
        assert other is not None and other.overlap_blocks == 0
        await asyncio.sleep(0.3)  # an ask would have been sent at once
        assert asked == []  # a worker that publishes no events has no state to give
        router.instance_removed(SILENT.instance_id)
        router.instance_added(SILENT)
        assert router.choose(request("r4"), [SILENT, TALKING]).overlap_blocks == 0  # type: ignore[union-attr]
    finally:
        await router.close()
