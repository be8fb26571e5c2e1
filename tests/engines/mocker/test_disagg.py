"""The mocker in disaggregated serving: a prefill-only request ends with a KV handoff, and a request that
brings one takes blocks and budget for its prompt but no prefill time, after the modelled transfer."""

import itertools
import time

import pytest

from engines.mocker.config import MockerConfig, parse_mocker_config
from engines.mocker.engine import MOCKER_HANDOFF, MockerEngine
from engines.mocker.scheduler import Scheduler, Sequence
from runtime.engine import RequestContext
from runtime.errors import ConfigError
from runtime.protocol import EngineOutput, KvHandoff, PreprocessedRequest, SamplingOptions, StopConditions

BLOCK = 4
_ids = itertools.count()


def request(tokens: list[int], max_tokens: int = 4, **fields: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"disagg-{next(_ids)}",
        model="mocker",
        token_ids=tokens,
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=max_tokens),
        **fields,  # type: ignore[arg-type]
    )


async def collect(engine: MockerEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    return [output async for output in engine.generate(req, RequestContext(req.request_id))]


async def started(**settings: object) -> MockerEngine:
    values: dict[str, object] = {"block_size": BLOCK, "num_gpu_blocks": 64, "speedup_ratio": 0, **settings}
    engine = MockerEngine(MockerConfig(**values), vocab_size=100)  # type: ignore[arg-type]
    await engine.start()
    return engine


async def test_a_prefill_only_request_computes_the_prompt_and_one_token_and_ends_with_a_handoff() -> None:
    # SmolLM2-135M's KV in bf16 (23040 B/token) over 1 GB/s: 23.04 us a token.
    engine = await started(kv_transfer_bandwidth=1.0, kv_bytes_per_token=23040)
    try:
        prompt = list(range(10, 20))
        outputs = await collect(engine, request(prompt, max_tokens=50, prefill_only=True))
        again = await collect(engine, request(prompt, max_tokens=50, prefill_only=True))
    finally:
        await engine.close()
    assert sum(len(output.token_ids) for output in outputs) == 1  # max_tokens is the decode worker's
    assert outputs[-1].finish_reason == "length"
    handoff = outputs[-1].handoff
    assert handoff is not None and all(output.handoff is None for output in outputs[:-1])
    assert (handoff.kind, handoff.prompt_tokens, handoff.cached_tokens) == (MOCKER_HANDOFF, 10, 0)
    assert handoff.transfer_s == pytest.approx(10 * 23040 / 1e9)
    # The same prompt again: the prefill worker's cache holds its two full blocks.
    assert again[-1].handoff is not None and again[-1].handoff.cached_tokens == 2 * BLOCK


async def test_without_a_bandwidth_or_bytes_per_token_the_handoff_takes_no_time() -> None:
    for settings in ({}, {"kv_transfer_bandwidth": 0.0, "kv_bytes_per_token": 1000}, {"kv_transfer_bandwidth": 5.0}):
        engine = await started(**settings)
        try:
            outputs = await collect(engine, request(list(range(8)), prefill_only=True))
        finally:
            await engine.close()
        assert outputs[-1].handoff is not None and outputs[-1].handoff.transfer_s == 0.0, settings


async def test_a_request_with_a_handoff_waits_the_transfer_then_generates_all_its_tokens() -> None:
    engine = await started(speedup_ratio=10)
    try:
        handoff = KvHandoff(kind=MOCKER_HANDOFF, prompt_tokens=8, transfer_s=0.5)  # 50 ms at speed-up 10
        begun = time.monotonic()
        outputs = await collect(engine, request(list(range(8)), max_tokens=3, handoff=handoff))
        waited = time.monotonic() - begun
    finally:
        await engine.close()
    assert sum(len(output.token_ids) for output in outputs) == 3 and outputs[-1].handoff is None
    assert waited >= 0.05  # the transfer comes first (a lower bound: sleeping never takes less)


async def test_a_handoff_of_another_engine_is_ignored_and_the_prompt_computed() -> None:
    engine = await started()
    try:
        handoff = KvHandoff(kind="vllm", prompt_tokens=8, transfer_s=1000.0)
        outputs = await collect(engine, request(list(range(8)), max_tokens=2, handoff=handoff))
    finally:
        await engine.close()
    assert sum(len(output.token_ids) for output in outputs) == 2


def test_a_transferred_prompt_takes_blocks_and_budget_but_no_prefill_time() -> None:
    rank = Scheduler(MockerConfig(block_size=BLOCK, num_gpu_blocks=64))
    flag = RequestContext("flag")
    transferred = Sequence("t", list(range(100, 112)), 2, seed=1, vocab_size=1000, stop=flag)
    transferred.transferred = True
    local = Sequence("l", list(range(200, 208)), 2, seed=2, vocab_size=1000, stop=flag)
    rank.add(transferred)
    rank.add(local)
    step = rank.schedule()
    assert step.scheduled == {transferred: 12, local: 8}  # both prompts take the step's budget...
    assert step.prefill_tokens() == 8  # ...but only the one computed here is timed as a prefill
    assert rank.cache.active_blocks == 5  # and both hold their blocks (3 + 2)
    rank.complete(step)
    assert len(transferred.output) == 1  # the first token comes from the decode worker's own pass


def test_a_preempted_transferred_sequence_computes_its_prompt_when_it_comes_back() -> None:
    rank = Scheduler(MockerConfig(block_size=BLOCK, num_gpu_blocks=64))
    sequence = Sequence("p", list(range(8)), 4, seed=3, vocab_size=1000, stop=RequestContext("p"))
    sequence.transferred = True
    rank.add(sequence)
    rank.complete(rank.schedule())
    rank._preempt(sequence)  # as a step does when blocks run out
    assert not sequence.transferred


def test_the_transfer_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="kv_transfer_bandwidth"):
        parse_mocker_config({"kv_transfer_bandwidth": -1})
    with pytest.raises(ConfigError, match="kv_bytes_per_token"):
        parse_mocker_config({"kv_bytes_per_token": 0})
    assert parse_mocker_config({"kv_transfer_bandwidth": 64, "kv_bytes_per_token": 131072}).kv_bytes_per_token == 131072
