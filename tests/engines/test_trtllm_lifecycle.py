"""The TensorRT-LLM worker over its whole life, against the fake of tests/engines/trtllm_fake.py: started as
``start()`` starts it, its KV-event and stats readers, close(), attention DP, ignore_eos, refusals and the
memory share. Each test's docstring names the TensorRT-LLM (or Dynamo) source its fake behaviour follows."""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engines.shared.gpu_engine_args import GpuPlacement
from engines.trtllm import engine as trtllm_engine
from engines.trtllm.engine import TrtLlmEngine, sampling_kwargs
from runtime.engine import RequestContext
from runtime.errors import RequestRejected
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored, KvEvent
from runtime.protocol import EngineOutput, PreprocessedRequest, SamplingOptions, StopConditions
from tests.engines.trtllm_fake import (
    NO_TOKENIZER_MESSAGE,
    FakeLlm,
    FakeNvml,
    FakeRequestError,
    FakeResult,
    FakeSchedulingParams,
    FakeTrtLlm,
    install,
)

GiB = 2**30
TOKENS = list(range(300, 364))  # two blocks of 32


def request(*, eos: list[int] | None = None, dp_rank: int | None = None, **stop: Any) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r1",
        model="m",
        token_ids=[1, 2, 3],
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=stop.pop("max_tokens", 4), **stop),
        eos_token_ids=[2, 7] if eos is None else eos,
        dp_rank=dp_rank,
    )


async def generate(engine: TrtLlmEngine, req: PreprocessedRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(req, RequestContext(req.request_id))]


def stored(tokens: list[int], hashes: list[int], parent: int | None = None, **extra: Any) -> dict[str, Any]:
    blocks = [
        {
            "type": "stored_block",
            "block_hash": block_hash,
            "tokens": [
                {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens[i * 32 : i * 32 + 32]
            ],
            "cache_level": 0,
            "priority": 35,
        }
        for i, block_hash in enumerate(hashes)
    ]
    return {"event_id": 1, "data": {"type": "stored", "parent_hash": parent, "blocks": blocks}, **extra}


class Sink:
    def __init__(self) -> None:
        self.published: list[tuple[int, list[KvEvent]]] = []

    def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
        self.published.append((dp_rank, events))


@pytest.fixture
def fast_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers whose iterators end after 10 ms without an item (1 s in the worker), so idle spells are short."""
    monkeypatch.setattr(trtllm_engine, "READ_TIMEOUT_S", 0.01, raising=False)


@pytest.fixture
async def started(monkeypatch: pytest.MonkeyPatch, fast_reads: None) -> AsyncIterator[tuple[TrtLlmEngine, FakeLlm]]:
    """A worker started by ``start()`` on the fake TensorRT-LLM, with a KV event sink; closed after the test."""
    llm = FakeLlm(model_tokens=[5, 6, 7, 8])
    install(monkeypatch, llm)
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    await engine.start()
    engine.attach_kv_events(Sink())
    yield engine, llm
    await engine.close()


async def test_the_readers_ask_trtllm_nothing_before_the_first_request(started: tuple[TrtLlmEngine, FakeLlm]) -> None:
    """GenerationExecutor.aget_kv_events asserts its queue exists and aget_stats prints a line and gives nothing
    until the first generate_async creates them (tensorrt_llm/executor/executor.py,
    _maybe_initialize_iteration_results); Dynamo starts its publisher after the first output
    (HandlerBase.generate_locally)."""
    engine, llm = started
    await asyncio.sleep(0)  # a reader started by start() would have run by now
    assert llm.stats_unavailable == 0
    assert llm.events is None and engine._events_task is None


async def test_kv_events_and_stats_are_read_from_the_first_request_on_and_after_an_idle_spell(
    started: tuple[TrtLlmEngine, FakeLlm],
) -> None:
    """IterationResult (tensorrt_llm/executor/result.py) ends after its timeout without an item and stays ended
    until the next generate_async marks it undone: the reader asks again, as Dynamo's Publisher._polling_loop."""
    engine, llm = started
    sink = engine._sink
    assert isinstance(sink, Sink)
    await generate(engine, request())
    assert llm.events is not None and llm.stats is not None
    llm.emit_kv_event(stored(TOKENS[:32], [10]))
    llm.emit_stats(
        {"numActiveRequests": 1, "numQueuedRequests": 0, "kvCacheStats": {"maxNumBlocks": 8, "usedNumBlocks": 3}}
    )
    await llm.events.handled()
    await llm.stats.handled()
    names = sequence_block_hashes(TOKENS, 32)
    assert sink.published == [(0, [BlockStored(block_hashes=names[:1])])]
    assert engine.load()[0].kv_active_blocks == 3

    await llm.events.ended.wait()  # idle: the events iterator ended, and stays ended until the next request
    await generate(engine, request())
    llm.emit_kv_event({**stored(TOKENS[32:], [11], parent=10), "event_id": 2})
    await llm.events.handled()
    assert sink.published[-1] == (0, [BlockStored(block_hashes=names[1:], parent_hash=names[0])])


async def test_a_reader_survives_an_event_it_cannot_read(started: tuple[TrtLlmEngine, FakeLlm]) -> None:
    """A malformed event (a stored block without its hash) is logged and the next one read: Dynamo's
    Publisher._polling_loop logs and polls on."""
    engine, llm = started
    await generate(engine, request())
    assert llm.events is not None
    broken = stored(TOKENS[:32], [10])
    del broken["data"]["blocks"][0]["block_hash"]
    llm.emit_kv_event(broken)
    llm.emit_kv_event(stored(TOKENS[:32], [10]))
    await llm.events.handled()
    assert engine.cache_state(0) == {0: [BlockStored(block_hashes=sequence_block_hashes(TOKENS[:32], 32))]}


async def test_close_shuts_trtllm_down_even_when_a_reader_died() -> None:
    """LLM.shutdown (tensorrt_llm/llmapi/llm.py) stops the executor and its MPI workers, which hold the GPUs'
    memory until then; Dynamo's TensorRTLLMEngine.cleanup calls it whatever happened before."""
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    llm = FakeLlm(FakeResult([]))
    engine._llm = llm

    async def died() -> None:
        raise AssertionError("KV Event IterationResult is not properly instantiated.")

    engine._events_task = asyncio.create_task(died())
    await asyncio.wait([engine._events_task])
    await engine.close()
    assert llm.shut_down


async def test_a_request_goes_to_the_attention_dp_rank_the_router_chose_and_each_rank_has_its_names(
    monkeypatch: pytest.MonkeyPatch, fast_reads: None
) -> None:
    """LLM.generate_async takes scheduling_params (tensorrt_llm/scheduling_params.py SchedulingParams), as
    Dynamo's HandlerBase passes the router's rank (attention_dp_relax=False); each rank's KV events carry its
    attention_dp_rank (KVCacheEventSerializer, tensorrt_llm/_utils.py)."""
    llm = FakeLlm(model_tokens=[5, 6])
    install(monkeypatch, llm)
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(tensor_parallel_size=2), {"enable_attention_dp": True})
    await engine.start()
    try:
        await generate(engine, request(dp_rank=1))
        await generate(engine, request())
        assert llm.scheduling == [FakeSchedulingParams(attention_dp_rank=1, attention_dp_relax=False), None]
        assert llm.events is not None
        llm.emit_kv_event(stored(TOKENS[:32], [10], attention_dp_rank=1))
        llm.emit_kv_event(stored(TOKENS[32:], [20], attention_dp_rank=0))
        await llm.events.handled()
        assert engine.cache_state(1) == {1: [BlockStored(block_hashes=sequence_block_hashes(TOKENS[:32], 32))]}
        assert engine.cache_state(0) == {0: [BlockStored(block_hashes=sequence_block_hashes(TOKENS[32:], 32))]}
    finally:
        await engine.close()


async def test_ignore_eos_generates_past_the_eos_and_sends_no_eos_stop_tokens(
    monkeypatch: pytest.MonkeyPatch, fast_reads: None
) -> None:
    """BaseWorker._enqueue_request (tensorrt_llm/executor/base_worker.py) sends end_id -1 and no stop words
    with ignore_eos; LLM._prepare_sampling_params (tensorrt_llm/llmapi/llm.py) still needs an end id without a
    tokenizer, so a model with no known EOS gets -1, the value TensorRT-LLM uses itself."""
    assert "stop_token_ids" not in sampling_kwargs(request(ignore_eos=True))
    llm = FakeLlm(model_tokens=[5, 2, 6, 7])
    install(monkeypatch, llm)
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    await engine.start()
    try:
        outputs = await generate(engine, request(ignore_eos=True))
        assert [token for out in outputs for token in out.token_ids] == [5, 2, 6, 7]
        assert outputs[-1].finish_reason == "length"
        outputs = await generate(engine, request(eos=[], ignore_eos=True))
        assert outputs[-1].finish_reason == "length"
        outputs = await generate(engine, request())
        assert [token for out in outputs for token in out.token_ids] == [5, 2]
        assert outputs[-1].finish_reason == "stop"
    finally:
        await engine.close()


@pytest.mark.parametrize(
    ("llm", "req", "reason"),
    [
        # LLM._check_arguments: the prompt (3 tokens) over max_num_tokens without chunked prefill.
        (FakeLlm(model_tokens=[5], max_num_tokens=2), request(), r".*should not exceed max_num_tokens \(2\)"),
        # LLM._prepare_sampling_params: no end id, and no tokenizer to find one.
        (FakeLlm(model_tokens=[5]), request(eos=[]), NO_TOKENIZER_MESSAGE),
    ],
    ids=["prompt-over-max_num_tokens", "no-end-id"],
)
async def test_generate_asyncs_argument_errors_are_refusals_with_trtllms_reason(
    monkeypatch: pytest.MonkeyPatch, fast_reads: None, llm: FakeLlm, req: PreprocessedRequest, reason: str
) -> None:
    """tensorrt_llm/llmapi/llm.py LLM.generate_async raises ValueError for a request it will not queue:
    RequestRejected, which the gateway answers 400 with the reason."""
    install(monkeypatch, llm)
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    await engine.start()
    try:
        with pytest.raises(RequestRejected, match=f"TensorRT-LLM refused the request: {reason}"):
            await generate(engine, req)
    finally:
        await engine.close()


async def test_the_executors_per_request_error_is_a_refusal(monkeypatch: pytest.MonkeyPatch, fast_reads: None) -> None:
    """GenerationResultBase._handle_response raises the executor's RequestError (tensorrt_llm/executor/utils.py)
    for a request it could not take (BaseWorker._enqueue_request wraps what the runtime raised)."""
    result = FakeResult([([5], None)])
    result.error = FakeRequestError("`max_tokens` (0) must be greater than 0")
    llm = FakeLlm(result)
    install(monkeypatch, llm)
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    await engine.start()
    try:
        with pytest.raises(RequestRejected, match="must be greater than 0"):
            await generate(engine, request())
    finally:
        await engine.close()


@pytest.mark.parametrize(("visible", "asked"), [(None, ("index", 0)), ("GPU-b1,GPU-b2", ("uuid", "GPU-b1"))])
async def test_the_memory_share_is_measured_without_opening_a_cuda_context(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, visible: str | None, asked: tuple[str, Any]
) -> None:
    """torch.cuda.mem_get_info opens a CUDA context in the worker, which TensorRT-LLM's executor does not use
    (its MPI workers run the model, tensorrt_llm/executor/proxy.py): NVML gives the free and total memory."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    (tmp_path / "model.safetensors").write_bytes(b"")
    nvml = FakeNvml(free=78 * GiB, total=80 * GiB)
    fake: FakeTrtLlm = install(monkeypatch, FakeLlm(FakeResult([])), nvml=nvml)
    engine = TrtLlmEngine(tmp_path, GpuPlacement(gpu_memory_fraction=0.5), {})
    await engine.start()
    try:
        assert fake.cuda_asked == 0
        assert nvml.asked == [asked]
        assert fake.llm_kwargs["kv_cache_config"].free_gpu_memory_fraction == pytest.approx(40 / 78)
    finally:
        await engine.close()
