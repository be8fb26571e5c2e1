"""The mocker engine with a host KV tier: its events and cache state name the cpu tier, its load reports it."""

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable

import pytest

from engines.mocker.config import MockerConfig
from engines.mocker.engine import MockerEngine
from runtime.engine import RequestContext
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored, KvEvent, TierLoad
from runtime.protocol import EngineOutput, PreprocessedRequest, SamplingOptions, StopConditions

BLOCK = 4
_ids = itertools.count()


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[int, KvEvent]] = []

    def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
        self.events.extend((dp_rank, event) for event in events)


def request(tokens: list[int], max_tokens: int = 1) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"host-{next(_ids)}",
        model="mocker",
        token_ids=tokens,
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=max_tokens),
        eos_token_ids=[2],
    )


@pytest.fixture
async def engine() -> AsyncIterator[MockerEngine]:
    # Speed-up 0: steps and copies take no time, but run in the same order.
    config = MockerConfig(
        speedup_ratio=0, block_size=BLOCK, num_gpu_blocks=8, num_host_blocks=16, kv_bytes_per_token=1000
    )
    mocker = MockerEngine(config, vocab_size=100)
    await mocker.start()
    yield mocker
    await mocker.close()


async def collect(engine: MockerEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    return [output async for output in engine.generate(req, RequestContext(req.request_id))]


def host_load(engine: MockerEngine) -> TierLoad:
    tiers = engine.load()[0].tiers
    assert tiers is not None and len(tiers) == 1
    return tiers[0]


async def until(condition: Callable[[], bool]) -> None:
    """Let the step loop run until ``condition`` holds (copies land a step after the request ends)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def test_load_reports_the_host_tier_its_use_hits_and_copies(engine: MockerEngine) -> None:
    assert host_load(engine) == TierLoad(
        medium="cpu", total_blocks=16, used_blocks=0, usage=0.0, hit_rate=None, offloaded_blocks=0, onboarded_blocks=0
    )
    prompt = list(range(16))  # 4 blocks
    await collect(engine, request(prompt))
    await until(lambda: host_load(engine).offloaded_blocks == 4)
    assert host_load(engine).used_blocks == 4 and host_load(engine).usage == 4 / 16
    await collect(engine, request(list(range(100, 132))))  # 8 blocks: the whole device
    await until(lambda: host_load(engine).offloaded_blocks == 12)
    outputs = await collect(engine, request(prompt))
    assert outputs[0].cached_tokens == 12  # 3 blocks came back from the host (the last is computed)
    tier = host_load(engine)
    assert tier.onboarded_blocks == 3
    assert tier.hit_rate == pytest.approx(12 / (16 + 32 + 16))
    assert engine.load()[0].prefix_hit_rate == 0.0  # the device's own hits: none


async def test_without_a_host_tier_load_reports_no_tiers() -> None:
    mocker = MockerEngine(MockerConfig(speedup_ratio=0, block_size=BLOCK), vocab_size=100)
    assert mocker.load()[0].tiers is None


async def test_the_sink_and_the_cache_state_carry_the_cpu_tier(engine: MockerEngine) -> None:
    sink = RecordingSink()
    engine.attach_kv_events(sink)
    prompt = list(range(500, 512))
    hashes = sequence_block_hashes(prompt, BLOCK)
    await collect(engine, request(prompt))
    await until(lambda: len(sink.events) == 2)
    # Stored on the device first, then, once copied, on the host.
    assert sink.events == [(0, BlockStored(hashes, None)), (0, BlockStored(hashes, None, medium="cpu"))]
    assert engine.cache_state(0) == {0: [BlockStored(hashes, None), BlockStored(hashes, None, medium="cpu")]}
