"""The mocker engine end to end: streams, cached tokens, stops, dp ranks, KV events, a failing step loop."""

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest

from engines.mocker.config import MockerConfig
from engines.mocker.engine import MockerEngine
from engines.mocker.scheduler import Scheduler, Step
from runtime.engine import RequestContext, TokenEngine
from runtime.errors import EngineError
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import AllCleared, BlockStored, KvEvent, KvEventSource
from runtime.protocol import EngineOutput, PreprocessedRequest, SamplingOptions, StopConditions

BLOCK = 4
_ids = itertools.count()


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[int, KvEvent]] = []

    def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
        self.events.extend((dp_rank, event) for event in events)


def request(tokens: list[int], max_tokens: int = 4, dp_rank: int | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"req-{next(_ids)}",
        model="mocker",
        token_ids=tokens,
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=max_tokens),
        eos_token_ids=[2],
        dp_rank=dp_rank,
    )


@pytest.fixture
async def engine() -> AsyncIterator[MockerEngine]:
    mocker = MockerEngine(MockerConfig(speedup_ratio=0, block_size=BLOCK, num_gpu_blocks=64, dp_size=2), vocab_size=100)
    await mocker.start()
    yield mocker
    await mocker.close()


async def collect(engine: MockerEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    return [output async for output in engine.generate(req, RequestContext(req.request_id))]


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


async def test_the_mocker_is_a_token_engine_and_a_kv_event_source(engine: MockerEngine) -> None:
    assert isinstance(engine, TokenEngine)
    assert isinstance(engine, KvEventSource)


async def test_a_request_streams_max_tokens_tokens_and_ends_with_length(engine: MockerEngine) -> None:
    outputs = await collect(engine, request(list(range(10)), max_tokens=7))
    tokens = tokens_of(outputs)
    assert len(tokens) == 7 and 2 not in tokens and all(0 <= token < 100 for token in tokens)
    assert outputs[-1].finish_reason == "length"
    assert all(output.finish_reason is None for output in outputs[:-1])
    assert outputs[0].cached_tokens == 0
    assert all(output.cached_tokens is None for output in outputs[1:])


async def test_a_repeated_prompt_reports_its_cached_tokens(engine: MockerEngine) -> None:
    prompt = list(range(100, 110))
    await collect(engine, request(prompt, dp_rank=0))
    again = await collect(engine, request(prompt, dp_rank=0))
    assert again[0].cached_tokens == 8
    elsewhere = await collect(engine, request(prompt, dp_rank=1))
    assert elsewhere[0].cached_tokens == 0  # each rank has its own cache


async def test_a_request_that_leaves_frees_its_blocks_at_once(engine: MockerEngine) -> None:
    req = request(list(range(10)), max_tokens=1000, dp_rank=0)
    stream = engine.generate(req, RequestContext(req.request_id))
    await anext(stream)
    assert engine.load()[0].kv_active_blocks >= 3  # the prompt's and what it generated since
    await stream.aclose()
    load = engine.load()[0]
    assert (load.kv_active_blocks, load.active_requests) == (0, 0)


async def test_a_stopped_context_ends_the_stream(engine: MockerEngine) -> None:
    req = request(list(range(10)), max_tokens=1000, dp_rank=0)
    context = RequestContext(req.request_id)
    outputs = []
    async for output in engine.generate(req, context):
        outputs.append(output)
        context.stop()
    assert len(outputs) == 1
    assert engine.load()[0].kv_active_blocks == 0


async def test_the_router_chosen_rank_is_used_else_the_least_loaded(engine: MockerEngine) -> None:
    held = request(list(range(10)), max_tokens=1000, dp_rank=1)
    stream = engine.generate(held, RequestContext(held.request_id))
    await anext(stream)
    await collect(engine, request(list(range(300, 310))))  # no rank asked: rank 0 is idle
    loads = engine.load()
    assert (loads[0].active_requests, loads[1].active_requests) == (0, 1)
    assert loads[0].prefix_hit_rate == 0.0 and loads[1].kv_active_blocks >= 3
    await stream.aclose()


async def test_kv_events_reach_the_sink_per_rank_and_match_the_cache_state(engine: MockerEngine) -> None:
    sink = RecordingSink()
    engine.attach_kv_events(sink)
    prompt = list(range(500, 512))
    await collect(engine, request(prompt, max_tokens=1, dp_rank=1))
    expected = sequence_block_hashes(prompt, BLOCK)
    assert sink.events == [(1, BlockStored(expected, None))]
    assert engine.cache_state(1) == {1: [BlockStored(expected, None)]}
    assert engine.cache_state(None) == {0: [], 1: [BlockStored(expected, None)]}
    assert engine.cache_state(7) == {}


async def test_a_prompts_blocks_are_announced_once_its_step_has_run_before_its_token_goes_out() -> None:
    mocker = MockerEngine(MockerConfig(speedup_ratio=1, block_size=BLOCK, num_gpu_blocks=64), vocab_size=100)
    await mocker.start()
    announced: list[tuple[KvEvent, int | None]] = []

    class Sink:
        def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
            # What the rank had generated when the events left: 0 while the prefill step is still to run.
            generated = mocker.load()[dp_rank].generated_tokens
            announced.extend((event, generated) for event in events)

    mocker.attach_kv_events(Sink())
    prompt = list(range(600, 612))
    try:
        outputs = await collect(mocker, request(prompt, max_tokens=1))
    finally:
        await mocker.close()
    assert tokens_of(outputs)
    assert announced == [(BlockStored(sequence_block_hashes(prompt, BLOCK), None), 0)]


async def test_reset_prefix_cache_tells_the_sink(engine: MockerEngine) -> None:
    sink = RecordingSink()
    engine.attach_kv_events(sink)
    await collect(engine, request(list(range(8)), max_tokens=1, dp_rank=0))
    sink.events.clear()
    assert engine.reset_prefix_cache() == 2
    assert sink.events == [(0, AllCleared())]
    assert engine.cache_state(0) == {0: []}


async def test_an_impossible_prompt_fails_with_an_engine_error(engine: MockerEngine) -> None:
    with pytest.raises(EngineError, match="KV blocks"):
        await collect(engine, request(list(range(400))))


async def test_a_failing_step_loop_fails_its_requests_and_the_rank_serves_again(
    engine: MockerEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = RecordingSink()
    engine.attach_kv_events(sink)
    original = Scheduler.schedule
    failures = iter([True])

    def schedule_once_broken(self: Scheduler, now: float | None = None) -> Step:
        if next(failures, False):
            raise RuntimeError("simulated bug")
        return original(self, now)

    monkeypatch.setattr(Scheduler, "schedule", schedule_once_broken)
    with pytest.raises(EngineError, match="simulated bug"):
        await collect(engine, request(list(range(10)), dp_rank=0))
    assert (0, AllCleared()) in sink.events
    outputs = await collect(engine, request(list(range(10)), dp_rank=0))
    assert outputs[-1].finish_reason == "length"


async def test_closing_the_engine_ends_requests_in_flight_with_an_error() -> None:
    mocker = MockerEngine(MockerConfig(speedup_ratio=0.001), vocab_size=100)  # steps of many seconds
    await mocker.start()
    req = request(list(range(10)))
    waiting = asyncio.create_task(collect(mocker, req))
    await mocker._ranks[0].wake.wait()  # set once the request is queued
    assert mocker.load()[0].active_requests == 1
    await mocker.close()
    with pytest.raises(EngineError, match="closed"):
        await waiting
    with pytest.raises(EngineError, match="not running"):
        await collect(mocker, request([1, 2, 3]))


async def test_a_migrated_request_continues_from_its_tokens(engine: MockerEngine) -> None:
    req = request(list(range(10)), max_tokens=3)
    req.migrated_tokens = 4
    outputs = await collect(engine, req)
    assert len(tokens_of(outputs)) == 3


async def test_load_counts_the_tokens_each_rank_generated(engine: MockerEngine) -> None:
    before = sum(report.generated_tokens or 0 for report in engine.load())
    await collect(engine, request([5, 6, 7, 8, 9], max_tokens=6))
    await collect(engine, request([1, 2, 3], max_tokens=4))
    assert sum(report.generated_tokens or 0 for report in engine.load()) == before + 10
