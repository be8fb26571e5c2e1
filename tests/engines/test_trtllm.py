"""The TensorRT-LLM engine without TensorRT-LLM: its arguments, memory share, sampling, streaming, abort and
KV event translation.

TensorRT-LLM needs CUDA and does not install here; its KV events are dicts shaped as its
KVCacheEventSerializer writes them (tensorrt_llm/_utils.py), and its LLM is the stand-in of
tests/engines/trtllm_fake.py.
"""

import importlib.util
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.gpu_engine_args import GpuPlacement
from engines.trtllm.engine import (
    DEFAULT_TOKENS_PER_BLOCK,
    EVENT_BUFFER_MAX_SIZE,
    TrtLlmEngine,
    finish_reason,
    kv_cache_fraction,
    llm_kwargs,
    parse_engine_args,
    sampling_kwargs,
    visible_devices,
    weight_bytes_per_gpu,
)
from engines.trtllm.kv_events import translate_event, translate_events
from runtime.engine import RequestContext
from runtime.errors import ConfigError, EngineError
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockRemoved, BlockStored, TierLoad
from runtime.protocol import (
    EngineOutput,
    GuidedDecoding,
    KvHandoff,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from tests.engines.trtllm_fake import FakeGuidedDecodingParams, FakeLlm, FakeResult

GiB = 2**30


def request(sampling: SamplingOptions | None = None, **stop: Any) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r1",
        model="m",
        token_ids=[1, 2, 3],
        sampling=sampling or SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=8, **stop),
        eos_token_ids=[2, 7],
    )


# --- arguments -------------------------------------------------------------------------------------------


def test_documented_llm_arguments_pass_through_and_kv_cache_config_is_merged() -> None:
    args = parse_engine_args('{"max_batch_size": 64, "kv_cache_config": {"tokens_per_block": 64, "dtype": "fp8"}}')
    kwargs = llm_kwargs(Path("/models/m"), GpuPlacement(), args)
    assert kwargs["max_batch_size"] == 64
    assert kwargs["kv_cache_config"] == {
        "enable_block_reuse": True,
        "tokens_per_block": 64,
        "dtype": "fp8",
        "event_buffer_max_size": EVENT_BUFFER_MAX_SIZE,
    }
    assert TrtLlmEngine(Path("/m"), GpuPlacement(), args).block_size == 64
    assert TrtLlmEngine(Path("/m"), GpuPlacement(), {}).block_size == DEFAULT_TOKENS_PER_BLOCK


@pytest.mark.skipif(importlib.util.find_spec("yaml") is None, reason="PyYAML comes with TensorRT-LLM")
def test_extra_args_are_read_as_yaml(tmp_path: Path) -> None:
    path = tmp_path / "trtllm.yaml"
    path.write_text("max_batch_size: 32\nkv_cache_config:\n  enable_block_reuse: false\n")
    assert parse_engine_args(path) == {"max_batch_size": 32, "kv_cache_config": {"enable_block_reuse": False}}


def test_extra_args_in_json_form_are_yaml_too(tmp_path: Path) -> None:
    path = tmp_path / "trtllm.yaml"
    path.write_text('{"max_num_tokens": 8192}')
    assert parse_engine_args(path) == {"max_num_tokens": 8192}


def test_an_unknown_llm_argument_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'max_batch' for out=trtllm.*LLM arguments"):
        parse_engine_args('{"max_batch": 4}')


@pytest.mark.parametrize("name", ["enable_trtllm_sampler", "kv_cache_dtype", "allreduce_strategy", "batching_type"])
def test_torchllmargs_of_trtllm_1_0_are_accepted(name: str) -> None:
    """TensorRT-LLM 1.0's TorchLlmArgs, as tests/unittest/api_stability/references/llm.yaml (1.0.0rc4) lists them."""
    assert parse_engine_args(f'{{"{name}": null}}') == {name: None}


@pytest.mark.parametrize(
    "name",
    [
        "sampler_type",  # replaced enable_trtllm_sampler after 1.0
        "batch_wait_timeout_ms",  # after 1.0
        "served_model_name",  # trtllm-serve's flag, not an LLM argument
        "build_config",  # the TensorRT-engine backend's; Flotilla runs the PyTorch backend
    ],
)
def test_names_that_are_not_trtllm_1_0_torchllmargs_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown key '{name}' for out=trtllm.*TensorRT-LLM 1.0's LLM arguments"):
        parse_engine_args(f'{{"{name}": null}}')


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"tensor_parallel_size": 2}', "'tensor_parallel_size' is set by Flotilla.*--tensor-parallel-size"),
        ('{"max_seq_len": 2}', "'max_seq_len' is set by Flotilla.*--context-length"),
        (
            '{"kv_cache_config": {"free_gpu_memory_fraction": 0.9}}',
            "kv_cache_config.free_gpu_memory_fraction is set by Flotilla.*--gpu-memory-utilization",
        ),
        ('{"kv_cache_config": 3}', "kv_cache_config must be a mapping"),
    ],
)
def test_what_flotilla_sets_is_refused_in_the_extra_args(raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_engine_args(raw)


def test_the_placement_becomes_the_llms_arguments() -> None:
    placement = GpuPlacement(tensor_parallel_size=4, context_length=8192)
    kwargs = llm_kwargs(Path("/models/m"), placement, {})
    assert (kwargs["model"], kwargs["tensor_parallel_size"], kwargs["max_seq_len"]) == ("/models/m", 4, 8192)
    assert kwargs["skip_tokenizer_init"] is True
    assert kwargs["kv_cache_config"]["enable_block_reuse"] is True


def test_the_memory_share_counts_the_weights_in_as_the_control_plane_does() -> None:
    # An 80 GiB GPU, 78 GiB free, 16 GiB of weights, a 0.5 share: 40 GiB in all, so 24 GiB of KV cache out of
    # the 62 GiB free after the weights.
    fraction = kv_cache_fraction(0.5, total_bytes=80 * GiB, free_bytes=78 * GiB, weight_bytes=16 * GiB)
    assert fraction == pytest.approx(24 / 62)
    assert 16 * GiB + fraction * 62 * GiB == pytest.approx(40 * GiB)


def test_a_share_smaller_than_the_weights_is_refused() -> None:
    with pytest.raises(ConfigError, match="weights alone"):
        kv_cache_fraction(0.1, total_bytes=80 * GiB, free_bytes=80 * GiB, weight_bytes=16 * GiB)


def test_the_weights_per_gpu_are_the_safetensors_split_over_the_tensor_parallel_gpus(tmp_path: Path) -> None:
    (tmp_path / "model-1.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-2.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "config.json").write_text("{}")
    assert weight_bytes_per_gpu(tmp_path, 2) == 200


def test_the_base_gpu_narrows_cuda_visible_devices() -> None:
    assert visible_devices("GPU-a,GPU-b,GPU-c", 1, 2) == "GPU-b,GPU-c"
    assert visible_devices(None, 2, 1) == "2"
    assert visible_devices("0,1", 0, 2) is None
    with pytest.raises(ConfigError, match="needs 3 visible GPUs"):
        visible_devices("0,1", 1, 2)


# --- sampling and streaming ------------------------------------------------------------------------------


def test_sampling_options_map_to_trtllms_sampling_params() -> None:
    sampling = SamplingOptions(temperature=0.0, top_k=-1, top_p=0.8, seed=9, frequency_penalty=0.5)
    assert sampling_kwargs(request(sampling, min_tokens=1)) == {
        "max_tokens": 8,
        "min_tokens": 1,
        "ignore_eos": False,
        "stop_token_ids": [2, 7],
        "end_id": 2,
        "detokenize": False,
        "temperature": 0.0,
        "top_p": 0.8,
        "top_k": 0,
        "frequency_penalty": 0.5,
        "seed": 9,
    }


@pytest.mark.parametrize(
    ("constraint", "guide"),
    [
        ({"json_schema": '{"type": "object"}'}, {"json": '{"type": "object"}'}),
        ({"guided": GuidedDecoding(regex="[0-9]+")}, {"regex": "[0-9]+"}),
        ({"guided": GuidedDecoding(choice=["yes", "no"])}, {"regex": "(yes|no)"}),
        ({"guided": GuidedDecoding(grammar='root ::= "x"')}, {"grammar": 'root ::= "x"'}),
    ],
)
def test_a_constraint_becomes_trtllms_guided_decoding_params(constraint: dict[str, Any], guide: dict[str, str]) -> None:
    """TensorRT-LLM follows one guide at a time (tensorrt_llm/sampling_params.py, GuidedDecodingParams), by the
    grammar backend the LLM was built with (``guided_decoding_backend``, xgrammar unless the arguments say)."""
    constrained = msgspec.structs.replace(request(), **constraint)
    params = sampling_kwargs(constrained, FakeGuidedDecodingParams)
    assert params["guided_decoding"] == FakeGuidedDecodingParams(**guide)
    assert "guided_decoding" not in sampling_kwargs(request(), FakeGuidedDecodingParams)
    assert llm_kwargs(Path("/models/m"), GpuPlacement(), {})["guided_decoding_backend"] == "xgrammar"
    chosen = {"guided_decoding_backend": "llguidance"}
    assert llm_kwargs(Path("/models/m"), GpuPlacement(), chosen)["guided_decoding_backend"] == "llguidance"


def test_finish_reasons_map_to_flotillas() -> None:
    reasons = (None, "stop", "length", "cancelled", "timeout")
    assert [finish_reason(r) for r in reasons] == [None, "stop", "length", "cancelled", "error"]


@pytest.fixture
async def closing() -> AsyncIterator[list[TrtLlmEngine]]:
    """Engines to close after the test (a request starts their KV-event and stats readers)."""
    engines: list[TrtLlmEngine] = []
    yield engines
    for engine in engines:
        await engine.close()


def started_engine(result: FakeResult, closing: list[TrtLlmEngine]) -> tuple[TrtLlmEngine, FakeLlm]:
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    llm = FakeLlm(result)
    engine._llm = llm
    engine._sampling_params = dict  # SamplingParams(**kwargs), as a dict
    closing.append(engine)
    return engine, llm


async def test_a_stream_yields_the_new_tokens_of_each_step_and_the_finish_reason(
    closing: list[TrtLlmEngine],
) -> None:
    result = FakeResult([([5], None), ([5, 6, 7], None), ([5, 6, 7, 2], "stop")])
    engine, llm = started_engine(result, closing)
    outputs = [out async for out in engine.generate(request(), RequestContext("r1"))]
    assert [out.token_ids for out in outputs] == [[5], [6, 7], [2]]
    assert outputs[-1].finish_reason == "stop"
    inputs, params, streaming = llm.calls[0]
    assert inputs == {"prompt_token_ids": [1, 2, 3]} and streaming is True and params["max_tokens"] == 8
    assert not result.aborted


async def test_a_consumer_that_stops_early_aborts_the_request_in_trtllm(closing: list[TrtLlmEngine]) -> None:
    result = FakeResult([([5], None), ([5, 6], None), ([5, 6, 7], "length")])
    engine, _ = started_engine(result, closing)
    stream = cast(AsyncGenerator[EngineOutput], engine.generate(request(), RequestContext("r1")))
    await anext(stream)
    await stream.aclose()
    assert result.aborted


# --- KV events -------------------------------------------------------------------------------------------

TOKENS = list(range(200, 264))  # two blocks of 32


def stored_block(block_hash: int, tokens: list[int], cache_level: int = 0) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": block_hash,
        "tokens": [{"type": "unique_token", "token_id": token, "token_extra_id": 0} for token in tokens],
        "cache_level": cache_level,
        "priority": 35,
    }


def event(data: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"event_id": 1, "data": data, "window_size": 32, **extra}


def test_trtllms_stored_and_removed_events_become_flotillas() -> None:
    names = EngineBlockNames(32)
    stored = event(
        {
            "type": "stored",
            "parent_hash": None,
            "blocks": [stored_block(10, TOKENS[:32]), stored_block(11, TOKENS[32:])],
        }
    )
    flotilla = sequence_block_hashes(TOKENS, 32)
    assert translate_event(stored, names) == [BlockStored(block_hashes=flotilla, parent_hash=None)]
    assert translate_event(event({"type": "removed", "block_hashes": [11]}), names) == [
        BlockRemoved(block_hashes=[flotilla[1]])
    ]


def test_blocks_stored_on_the_host_pool_are_a_run_of_their_own_tier() -> None:
    names = EngineBlockNames(32)
    stored = event(
        {
            "type": "stored",
            "parent_hash": None,
            "blocks": [stored_block(10, TOKENS[:32]), stored_block(11, TOKENS[32:], cache_level=1)],
        }
    )
    flotilla = sequence_block_hashes(TOKENS, 32)
    assert translate_event(stored, names) == [
        BlockStored(block_hashes=[flotilla[0]], parent_hash=None),
        BlockStored(block_hashes=[flotilla[1]], parent_hash=flotilla[0], medium="cpu"),
    ]


def updated(block_hash: int, old_level: int, new_level: int) -> dict[str, Any]:
    diff = {"type": "event_diff", "old_value": old_level, "new_value": new_level}
    return event({"type": "updated", "block_hash": block_hash, "cache_level": diff, "priority": None})


def test_a_block_moved_off_the_gpu_is_a_gpu_removal_and_a_host_store() -> None:
    names = EngineBlockNames(32)
    translate_event(event({"type": "stored", "parent_hash": None, "blocks": [stored_block(10, TOKENS[:32])]}), names)
    flotilla = sequence_block_hashes(TOKENS[:32], 32)
    assert translate_event(updated(10, 0, 1), names) == [
        BlockRemoved(block_hashes=flotilla),
        BlockStored(block_hashes=flotilla, parent_hash=None, medium="cpu"),
    ]
    assert names.state() == [BlockStored(block_hashes=flotilla, parent_hash=None, medium="cpu")]


def test_a_block_brought_back_to_the_gpu_is_a_host_removal_and_a_gpu_store_that_keeps_its_parent() -> None:
    names = EngineBlockNames(32)
    blocks = [stored_block(10, TOKENS[:32]), stored_block(11, TOKENS[32:])]
    translate_event(event({"type": "stored", "parent_hash": None, "blocks": blocks}), names)
    translate_event(updated(11, 0, 1), names)
    flotilla = sequence_block_hashes(TOKENS, 32)
    assert translate_event(updated(11, 1, 0), names) == [
        BlockRemoved(block_hashes=[flotilla[1]], medium="cpu"),
        BlockStored(block_hashes=[flotilla[1]], parent_hash=flotilla[0]),
    ]


def test_a_removal_takes_the_block_off_whichever_pool_holds_it() -> None:
    names = EngineBlockNames(32)
    translate_event(event({"type": "stored", "parent_hash": None, "blocks": [stored_block(10, TOKENS[:32])]}), names)
    translate_event(updated(10, 0, 1), names)
    assert translate_event(event({"type": "removed", "block_hashes": [10]}), names) == [
        BlockRemoved(block_hashes=sequence_block_hashes(TOKENS[:32], 32), medium="cpu")
    ]


def test_a_cache_level_flotilla_does_not_know_is_the_external_tier() -> None:
    names = EngineBlockNames(32)
    stored = event({"type": "stored", "parent_hash": None, "blocks": [stored_block(10, TOKENS[:32], cache_level=2)]})
    assert translate_event(stored, names) == [
        BlockStored(block_hashes=sequence_block_hashes(TOKENS[:32], 32), parent_hash=None, medium="external")
    ]


def test_a_trailing_partial_block_ends_the_stored_event_and_the_full_blocks_before_it_stand() -> None:
    """With partial reuse (KvCacheConfig.enable_partial_reuse, on by default) TensorRT-LLM stores a prompt's last,
    unfilled block too; Dynamo's Publisher._handle_kv_event stops at it and publishes the full blocks before."""
    names = EngineBlockNames(32)
    tail = list(range(900, 905))
    blocks = [stored_block(10, TOKENS[:32]), stored_block(11, TOKENS[32:]), stored_block(12, tail)]
    flotilla = sequence_block_hashes(TOKENS, 32)
    assert translate_event(event({"type": "stored", "parent_hash": None, "blocks": blocks}), names) == [
        BlockStored(block_hashes=flotilla, parent_hash=None)
    ]
    assert translate_event(event({"type": "removed", "block_hashes": [12]}), names) == []
    more = list(range(400, 432))
    later = event({"type": "stored", "parent_hash": 11, "blocks": [stored_block(13, more)]})
    assert translate_event(later, names) == [
        BlockStored(block_hashes=sequence_block_hashes(TOKENS + more, 32)[2:], parent_hash=flotilla[1])
    ]


def test_a_sliding_window_models_events_are_the_full_attention_pools_only() -> None:
    """TensorRT-LLM keeps a pool per attention window and each event carries its window_size
    (KVCacheEventSerializer, tensorrt_llm/_utils.py); its created events come first, one per pool. Dynamo's
    Publisher.should_drop_event keeps the largest window's; a sliding-window pool's removal of a block the full
    pool holds too (same tokens, same hash) must not take it from the router."""
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    sink = ListSink()
    engine.attach_kv_events(sink)
    full, sliding = 32768, 4096
    engine._on_kv_event(event({"type": "created", "num_blocks_per_cache_level": [50, 0]}, window_size=sliding))
    engine._on_kv_event(event({"type": "created", "num_blocks_per_cache_level": [100, 400]}, window_size=full))
    block = {"type": "stored", "parent_hash": None, "blocks": [stored_block(10, TOKENS[:32])]}
    engine._on_kv_event(event(block, window_size=sliding))
    engine._on_kv_event(event(block, window_size=full))
    engine._on_kv_event(event({"type": "removed", "block_hashes": [10]}, window_size=sliding))
    named = BlockStored(block_hashes=sequence_block_hashes(TOKENS[:32], 32))
    assert sink.published == [(0, [named])]
    assert engine.cache_state(0) == {0: [named]}
    assert engine._host_blocks == {0: 400}


def test_created_events_and_unknown_removals_say_nothing() -> None:
    names = EngineBlockNames(32)
    assert translate_event(event({"type": "created", "num_blocks_per_cache_level": [100, 0]}), names) == []
    assert translate_event(event({"type": "removed", "block_hashes": [5]}), names) == []


def test_events_are_grouped_by_attention_dp_rank() -> None:
    names = {0: EngineBlockNames(32), 1: EngineBlockNames(32)}
    events = [
        event({"type": "stored", "parent_hash": None, "blocks": [stored_block(10, TOKENS[:32])]}),
        event({"type": "stored", "parent_hash": None, "blocks": [stored_block(20, TOKENS[32:])]}, attention_dp_rank=1),
        event({"type": "stored", "parent_hash": None, "blocks": [stored_block(30, TOKENS[32:])]}, attention_dp_rank=5),
    ]
    translated = translate_events(events, names)
    assert set(translated) == {0, 1}
    assert translated[1] == [BlockStored(block_hashes=sequence_block_hashes(TOKENS[32:], 32))]


class ListSink:
    def __init__(self) -> None:
        self.published: list[tuple[int, list[Any]]] = []

    def publish(self, dp_rank: int, events: list[Any]) -> None:
        self.published.append((dp_rank, events))


def test_the_llms_kv_events_are_published_as_they_come_and_answer_a_state_request() -> None:
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    stored = event({"type": "stored", "parent_hash": None, "blocks": [stored_block(10, TOKENS[:32])]})
    created = event({"type": "created", "num_blocks_per_cache_level": [100, 0]})

    sink = ListSink()
    engine.attach_kv_events(sink)
    for each in (created, stored):
        engine._on_kv_event(each)
    named = sequence_block_hashes(TOKENS[:32], 32)
    assert sink.published == [(0, [BlockStored(block_hashes=named)])]
    assert engine.cache_state(None) == {0: [BlockStored(block_hashes=named)]}


def test_the_host_pool_the_cache_announces_is_the_load_reports_cpu_tier() -> None:
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    created = event({"type": "created", "num_blocks_per_cache_level": [100, 400]})
    blocks = [stored_block(10, TOKENS[:32]), stored_block(11, TOKENS[32:])]
    stored = event({"type": "stored", "parent_hash": None, "blocks": blocks})
    offloaded = event(
        {"type": "updated", "block_hash": 11, "cache_level": {"type": "event_diff", "old_value": 0, "new_value": 1}}
    )

    for each in (created, stored, offloaded):
        engine._on_kv_event(each)
    engine._stats.update({"numActiveRequests": 0, "kvCacheStats": {"maxNumBlocks": 100, "usedNumBlocks": 1}})
    [load] = engine.load()
    assert load.tiers == [TierLoad(medium="cpu", total_blocks=400, used_blocks=1, usage=1 / 400)]


def test_a_cache_without_a_host_pool_reports_no_tiers() -> None:
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    engine._stats.update({"numActiveRequests": 1})
    assert engine.load()[0].tiers is None


# --- disaggregated serving --------------------------------------------------------------------------------


class FakeDisaggregatedParams:
    """tensorrt_llm.llmapi.DisaggregatedParams: its keyword arguments, kept."""

    def __init__(self, **fields: Any) -> None:
        self.fields = fields


def disagg_request(**fields: Any) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r1", model="m", token_ids=[1, 2, 3], sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=8), eos_token_ids=[2], **fields,
    )  # fmt: skip


def disagg_engine(role: str, steps: list[Any], closing: list[TrtLlmEngine]) -> tuple[TrtLlmEngine, FakeLlm]:
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {"cache_transceiver_config": {"backend": "DEFAULT"}}, role=role)  # type: ignore[arg-type]
    result = FakeResult([])
    result.steps = steps
    llm = FakeLlm(result)
    engine._llm, engine._sampling_params, engine._disaggregated_params = llm, dict, FakeDisaggregatedParams
    closing.append(engine)
    return engine, llm


async def test_a_prefill_runs_context_only_and_hands_on_its_disaggregated_params(
    closing: list[TrtLlmEngine],
) -> None:
    class Steps(FakeResult):
        async def __aiter__(self) -> AsyncIterator[Any]:
            state = SimpleNamespace(ctx_request_id=77, opaque_state=b"\x00\xffstate", first_gen_tokens=[9])
            yield SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=[9], finish_reason="length", disaggregated_params=state)]
            )

    engine, llm = disagg_engine("prefill", [], closing)
    llm.result = Steps([])
    outputs = [out async for out in engine.generate(disagg_request(prefill_only=True), RequestContext("r1"))]
    [(_, params, _, extra)] = llm.calls
    assert params["max_tokens"] == 1 and extra["disaggregated_params"].fields == {"request_type": "context_only"}
    handoff = outputs[-1].handoff
    assert handoff is not None and handoff.kind == "trtllm"
    assert handoff.params == {"first_gen_tokens": [9], "ctx_request_id": 77, "opaque_state": {"base64": "AP9zdGF0ZQ=="}}


async def test_a_decode_runs_generation_only_with_the_prefills_params_decoded(closing: list[TrtLlmEngine]) -> None:
    engine, llm = disagg_engine("decode", [([5], None), ([5, 6], "length")], closing)
    params = {"ctx_request_id": 77, "opaque_state": {"base64": "AP9zdGF0ZQ=="}, "first_gen_tokens": [9]}
    handoff = KvHandoff(kind="trtllm", prompt_tokens=3, params=params)
    outputs = [out async for out in engine.generate(disagg_request(handoff=handoff), RequestContext("r1"))]
    assert [out.token_ids for out in outputs] == [[5], [6]]
    fields = llm.calls[0][3]["disaggregated_params"].fields
    assert fields == {"request_type": "generation_only", "ctx_request_id": 77, "opaque_state": b"\x00\xffstate",
                      "first_gen_tokens": [9]}  # fmt: skip


async def test_a_handoff_without_its_context_request_id_is_an_engine_error(closing: list[TrtLlmEngine]) -> None:
    engine, _ = disagg_engine("decode", [], closing)
    handoff = KvHandoff(kind="trtllm", prompt_tokens=3, params={"opaque_state": {"base64": ""}})
    with pytest.raises(EngineError, match="without ctx_request_id"):
        [out async for out in engine.generate(disagg_request(handoff=handoff), RequestContext("r1"))]


def test_a_prefill_or_decode_worker_needs_a_cache_transceiver() -> None:
    with pytest.raises(ConfigError, match="cache_transceiver_config"):
        TrtLlmEngine(Path("/m"), GpuPlacement(), {}, role="decode")
