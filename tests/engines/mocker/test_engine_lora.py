"""The mocker's LoRA adapters: loading them (runtime/lora.py LoraEngine), and blocks computed with an adapter
hashed apart from the base model's (as vLLM mixes the adapter into its block hashes), announced with its lora_id."""

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from engines.mocker.config import MockerConfig
from engines.mocker.engine import MockerEngine
from runtime.engine import RequestContext
from runtime.errors import EngineError
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored, KvEvent
from runtime.lora import LoraEngine, lora_id, lora_root_hash
from runtime.protocol import EngineOutput, PreprocessedRequest, SamplingOptions, StopConditions

BLOCK = 4
_ids = itertools.count()


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[KvEvent] = []

    def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
        self.events.extend(events)


def request(tokens: list[int], lora: str | None = None, max_tokens: int = 1) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"req-{next(_ids)}",
        model="mocker",
        token_ids=tokens,
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=max_tokens),
        eos_token_ids=[2],
        lora_name=lora,
    )


@pytest.fixture
async def engine() -> AsyncIterator[MockerEngine]:
    config = MockerConfig(speedup_ratio=0, block_size=BLOCK, num_gpu_blocks=64, max_loras=2, lora_load_time=0)
    mocker = MockerEngine(config, vocab_size=100)
    await mocker.start()
    yield mocker
    await mocker.close()


async def collect(engine: MockerEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    return [output async for output in engine.generate(req, RequestContext(req.request_id))]


async def test_the_mocker_is_a_lora_engine_holding_max_loras_adapters(engine: MockerEngine, tmp_path: Path) -> None:
    assert isinstance(engine, LoraEngine)
    assert engine.max_loras == 2
    await engine.load_lora("a", tmp_path)
    await engine.load_lora("a", tmp_path)  # the same again: nothing changes
    await engine.load_lora("b", tmp_path)
    with pytest.raises(EngineError, match="2 adapters at most"):
        await engine.load_lora("c", tmp_path)
    await engine.unload_lora("a")
    await engine.unload_lora("a")  # not loaded: nothing happens
    await engine.load_lora("c", tmp_path)
    assert sorted(engine.loras) == ["b", "c"]


async def test_an_adapter_whose_path_does_not_exist_is_refused(engine: MockerEngine, tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="does not exist"):
        await engine.load_lora("a", tmp_path / "missing")
    assert engine.loras == {}


async def test_a_request_for_an_adapter_not_loaded_ends_with_a_clear_error(engine: MockerEngine) -> None:
    with pytest.raises(EngineError, match="LoRA adapter 'nope' is not loaded"):
        await collect(engine, request([1, 3, 4, 5], lora="nope"))


async def test_adapter_blocks_are_hashed_apart_and_announced_with_their_lora_id(
    engine: MockerEngine, tmp_path: Path
) -> None:
    sink = RecordingSink()
    engine.attach_kv_events(sink)
    await engine.load_lora("a", tmp_path)
    prompt = list(range(10, 18))
    await collect(engine, request(prompt))
    await collect(engine, request(prompt, lora="a"))
    base = sequence_block_hashes(prompt, BLOCK)
    adapted = sequence_block_hashes(prompt, BLOCK, lora_root_hash(lora_id("a")))
    assert set(base).isdisjoint(adapted)
    assert sink.events == [BlockStored(base, None), BlockStored(adapted, None, lora_id=lora_id("a"))]
    state = engine.cache_state(0)[0]
    assert [(event.block_hashes, event.lora_id) for event in state] == [(base, None), (adapted, lora_id("a"))]
    # The wire carries it (routers filter on it).
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(state[1]), type=BlockStored).lora_id == lora_id("a")


async def test_a_prefix_is_reused_within_one_adapter_never_across_adapters_or_the_base(
    engine: MockerEngine, tmp_path: Path
) -> None:
    await engine.load_lora("a", tmp_path)
    await engine.load_lora("b", tmp_path)
    prompt = list(range(30, 39))  # two full blocks
    first = await collect(engine, request(prompt, lora="a"))
    assert first[0].cached_tokens == 0
    again = await collect(engine, request(prompt, lora="a"))
    assert again[0].cached_tokens == 2 * BLOCK
    other = await collect(engine, request(prompt, lora="b"))
    assert other[0].cached_tokens == 0
    base = await collect(engine, request(prompt))
    assert base[0].cached_tokens == 0
