"""The SGLang engine without SGLang: its arguments, sampling, streaming, abort and KV event translation.

SGLang needs CUDA and does not install here; its KV events are hand-built with msgspec structs declared
as SGLang declares them (python/sglang/srt/disaggregation/kv_events.py, sgl-project/sglang commit 006d053f),
and its Engine is a stand-in with the documented ``async_generate``/``abort_request``.
"""

import asyncio
import json
import signal
import socket
import sys
import threading
import types
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from engines.sglang.aborts import Aborts
from engines.sglang.engine import (
    DEFAULT_PAGE_SIZE,
    DP_ATTENTION_PORT_OFFSETS,
    SglangEngine,
    dp_attention_port,
    engine_kwargs,
    finish_reason,
    load_reports,
    local_dp_ranks,
    new_tokens,
    parse_engine_args,
    rank_endpoints,
)
from engines.sglang.requests import sampling_params
from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.gpu_engine_args import GpuPlacement
from engines.shared.node_group import LeaderAddress, NodeGroup
from engines.shared.zmq_kv_events import decode_message, free_tcp_ports, translate_batch
from runtime.engine import RequestContext
from runtime.errors import ConfigError, EngineError
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored
from runtime.protocol import EngineOutput, PreprocessedRequest, SamplingOptions, StopConditions


# SGLang's event types, as declared there (array_like, tagged with the class name).
class _Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStoredSg(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class BlockRemovedSg(_Event, tag="BlockRemoved"):
    block_hashes: list[int]


class AllBlocksClearedSg(_Event, tag="AllBlocksCleared"):
    pass


class KVEventBatchSg(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStoredSg | BlockRemovedSg | AllBlocksClearedSg]


def zmq_frames(*events: _Event) -> list[bytes]:
    """One message as SGLang's ZmqEventPublisher sends it: topic, 8-byte sequence number, msgpack batch."""
    batch = KVEventBatchSg(ts=1.5, events=list(events))  # type: ignore[arg-type]
    return [b"flotilla-kv", (0).to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


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


def test_documented_server_args_pass_through_to_the_engine() -> None:
    args = parse_engine_args('{"page_size": 32, "attention_backend": "fa3", "enable_dp_attention": false}')
    kwargs = engine_kwargs(Path("/models/m"), GpuPlacement(), args, kv_events_endpoint=None)
    assert (kwargs["page_size"], kwargs["attention_backend"], kwargs["enable_dp_attention"]) == (32, "fa3", False)


def test_an_unknown_server_arg_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'mem_fraction' for out=sglang.*ServerArgs"):
        parse_engine_args('{"page_size": 16, "mem_fraction": 0.5}')


@pytest.mark.parametrize(
    ("key", "flag"),
    [
        ("tp_size", "--tensor-parallel-size"),
        ("mem_fraction_static", "--gpu-memory-utilization"),
        ("base_gpu_id", "--base-gpu-id"),
        ("context_length", "--context-length"),
        ("nnodes", "--num-nodes"),
        ("node_rank", "--node-rank"),
        ("dist_init_addr", "--leader-addr"),
    ],
)
def test_a_server_arg_that_a_flag_sets_is_refused_naming_the_flag(key: str, flag: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}' is set by Flotilla for out=sglang.*{flag}"):
        parse_engine_args(json.dumps({key: 1}))


def test_extra_args_in_a_json_file_are_read(tmp_path: Path) -> None:
    path = tmp_path / "sglang.json"
    path.write_text('{"max_running_requests": 64}')
    assert parse_engine_args(path) == {"max_running_requests": 64}


@pytest.mark.parametrize("raw", ["[1, 2]", "{not json"])
def test_extra_args_that_are_not_a_json_object_are_refused(raw: str) -> None:
    with pytest.raises(ConfigError, match="--extra-engine-args"):
        parse_engine_args(raw)


def test_the_placement_becomes_sglangs_gpu_arguments() -> None:
    placement = GpuPlacement(tensor_parallel_size=2, base_gpu_id=1, context_length=4096, gpu_memory_fraction=0.45)
    kwargs = engine_kwargs(Path("/models/m"), placement, {}, kv_events_endpoint="tcp://*:5557")
    assert kwargs["model_path"] == "/models/m"
    assert (kwargs["tp_size"], kwargs["base_gpu_id"], kwargs["context_length"]) == (2, 1, 4096)
    assert kwargs["mem_fraction_static"] == 0.45
    assert kwargs["skip_tokenizer_init"] is True
    assert kwargs["page_size"] == DEFAULT_PAGE_SIZE
    assert json.loads(kwargs["kv_events_config"]) == {
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "topic": "flotilla-kv",
    }


def test_the_nodes_an_instance_spans_become_sglangs_multi_node_arguments() -> None:
    nodes = NodeGroup(num_nodes=2, node_rank=1, leader=LeaderAddress("10.0.0.1", 29500))
    kwargs = engine_kwargs(Path("/m"), GpuPlacement(tensor_parallel_size=16), {}, kv_events_endpoint=None, nodes=nodes)
    assert (kwargs["nnodes"], kwargs["node_rank"], kwargs["dist_init_addr"], kwargs["tp_size"]) == (
        2,
        1,
        "10.0.0.1:29500",
        16,
    )
    ipv6 = NodeGroup(num_nodes=2, leader=LeaderAddress("fd00::1", 29500))
    assert engine_kwargs(Path("/m"), GpuPlacement(), {}, kv_events_endpoint=None, nodes=ipv6)["dist_init_addr"] == (
        "[fd00::1]:29500"
    )
    alone = engine_kwargs(Path("/m"), GpuPlacement(), {}, kv_events_endpoint=None, nodes=NodeGroup())
    assert not {"nnodes", "node_rank", "dist_init_addr"} & set(alone)


def test_each_dp_attention_worker_on_a_node_gets_free_ports_of_its_own() -> None:
    """SGLang derives its dp-attention processes' TCP ports from ServerArgs.port (+233 to +239): at its
    default, two such workers on one node would wait on each other's ports."""
    dp = {"enable_dp_attention": True, "dp_size": 2}
    first = dp_attention_port(dp, None)
    assert first is not None and first + 10000 <= 65535  # SGLang refuses a gRPC port past 65535
    held = [socket.create_server(("127.0.0.1", first + offset)) for offset in DP_ATTENTION_PORT_OFFSETS]
    try:
        second = dp_attention_port(dp, NodeGroup())
        assert second is not None and second != first
        assert not {second + o for o in DP_ATTENTION_PORT_OFFSETS} & {first + o for o in DP_ATTENTION_PORT_OFFSETS}
    finally:
        for server in held:
            server.close()
    assert engine_kwargs(Path("/m"), GpuPlacement(), dp, kv_events_endpoint=None, port=first)["port"] == first
    # Without dp attention SGLang uses IPC; across nodes it derives them from --leader-addr: no port then.
    assert dp_attention_port({}, None) is None
    assert dp_attention_port(dp, NodeGroup(num_nodes=2, leader=LeaderAddress("10.0.0.1", 29500))) is None
    assert "port" not in engine_kwargs(Path("/m"), GpuPlacement(), {}, kv_events_endpoint=None)
    with pytest.raises(ConfigError, match="port"):
        parse_engine_args('{"port": 30000}')


def test_without_a_share_sglang_keeps_its_own_memory_default() -> None:
    kwargs = engine_kwargs(Path("/m"), GpuPlacement(), {}, kv_events_endpoint=None)
    assert "mem_fraction_static" not in kwargs and "context_length" not in kwargs
    assert "kv_events_config" not in kwargs


@pytest.mark.parametrize("fraction", [0.0, 1.5])
def test_a_memory_share_outside_zero_to_one_is_refused(fraction: float) -> None:
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        GpuPlacement(gpu_memory_fraction=fraction)


# --- sampling and streaming ------------------------------------------------------------------------------


def test_sampling_options_map_to_sglangs_sampling_params() -> None:
    sampling = SamplingOptions(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=3, repetition_penalty=1.1)
    params = sampling_params(request(sampling, min_tokens=2, ignore_eos=True))
    assert params == {
        "max_new_tokens": 8,
        "min_new_tokens": 0,  # min_tokens asks nothing with ignore_eos
        "ignore_eos": True,
        "stop_token_ids": [2, 7],
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "sampling_seed": 3,
    }


def test_unset_options_are_left_to_sglang_and_top_k_zero_means_none() -> None:
    params = sampling_params(request(SamplingOptions(top_k=0)))
    assert params["top_k"] == -1
    assert "temperature" not in params and "sampling_seed" not in params


def test_finish_reasons_map_to_flotillas() -> None:
    assert finish_reason({"finish_reason": None}) is None
    assert finish_reason({"finish_reason": {"type": "length", "length": 8}}) == "length"
    assert finish_reason({"finish_reason": {"type": "stop", "matched": 2}}) == "stop"
    assert finish_reason({"finish_reason": {"type": "abort", "message": "x"}}) == "error"


def test_new_tokens_are_taken_from_cumulative_and_incremental_output_ids_alike() -> None:
    cumulative = {"output_ids": [5, 6, 7], "meta_info": {"completion_tokens": 3}}
    incremental = {"output_ids": [7], "meta_info": {"completion_tokens": 3}}
    assert new_tokens(cumulative, 2) == [7]
    assert new_tokens(incremental, 2) == [7]
    assert new_tokens({"output_ids": [5], "meta_info": {"completion_tokens": 1}}, 0) == [5]


class FakeTokenizerManager:
    """The parts of SGLang's ``TokenizerManager`` (python/sglang/srt/managers/tokenizer_manager.py) the worker
    touches: ``rid_to_state`` (a request's state from its send to the scheduler until it ends),
    ``abort_request`` (an ``AbortReq`` to the scheduler, sent only for a rid it holds; the scheduler aborts what
    it has queued or running, after which SGLang drops the state) and ``auto_create_handle_loop`` (on its first
    call, in the main thread, ``loop.add_signal_handler`` for SIGTERM and SIGQUIT, as ``SignalHandler`` does).

    ``lost_aborts``: how many aborts reach the scheduler before the request does (pipeline parallel, attention
    DP) and are lost, as Dynamo's ``_retry_abort`` (cancellation.py) allows for."""

    def __init__(self, server_args: Any) -> None:
        self.server_args = server_args
        self.rid_to_state: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.lost_aborts = 0
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.sigterm = asyncio.Event()  # SGLang's SignalHandler.sigterm_handler ran

    def auto_create_handle_loop(self) -> None:
        if self.event_loop is not None:
            return
        loop = asyncio.get_running_loop()
        self.event_loop = loop
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGTERM, self.sigterm.set)
            loop.add_signal_handler(signal.SIGQUIT, self.sigterm.set)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if not abort_all and rid not in self.rid_to_state:
            return
        self.aborted.append(rid)
        if self.lost_aborts:
            self.lost_aborts -= 1
            return
        self.rid_to_state.pop(rid).set()  # the scheduler's abort came back: the state is dropped


class FakeSglang:
    """sglang.Engine (python/sglang/srt/entrypoints/engine.py): ``async_generate(stream=True, rid=...)`` returns
    ``TokenizerManager.generate_request``'s generator, which starts the manager's loop, registers the request in
    ``rid_to_state`` as it sends it to the scheduler, and yields its chunks; ``server_args`` as settled by
    ``ServerArgs.__post_init__``. ``queued``: the request waits in the scheduler's queue (no chunk) until aborted.
    A ValueError in ``refuse`` is raised where SGLang's request checks raise theirs, at the first chunk."""

    def __init__(
        self, chunks: list[dict[str, Any]], *, queued: bool = False, page_size: int = 16, refuse: str | None = None
    ) -> None:
        self.chunks = chunks
        self.queued = queued
        self.refuse = refuse
        self.calls: list[dict[str, Any]] = []
        self.server_args = SimpleNamespace(page_size=page_size)
        self.tokenizer_manager = FakeTokenizerManager(self.server_args)
        self.shut_down = False
        self.sent = asyncio.Event()  # a request reached the scheduler (rid_to_state holds it)

    @property
    def aborted(self) -> list[str]:
        return self.tokenizer_manager.aborted

    async def async_generate(self, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(kwargs)
        manager = self.tokenizer_manager
        rid = kwargs.get("rid") or "sg-1"

        async def stream() -> AsyncIterator[dict[str, Any]]:
            manager.auto_create_handle_loop()
            if self.refuse is not None:
                raise ValueError(self.refuse)
            state = manager.rid_to_state[rid] = asyncio.Event()
            self.sent.set()
            if self.queued:
                await state.wait()
                yield chunk([], 0, {"type": "abort", "message": "Abort in waiting queue"})
                return
            for item in self.chunks:
                if item["meta_info"].get("finish_reason"):
                    manager.rid_to_state.pop(rid, None)
                yield item

        return stream()

    def shutdown(self) -> None:
        self.shut_down = True


def chunk(ids: list[int], total: int, reason: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    return {"output_ids": ids, "meta_info": {"id": "sg-1", "completion_tokens": total, "finish_reason": reason, **meta}}


async def start_on_fake(
    monkeypatch: pytest.MonkeyPatch,
    fake: FakeSglang,
    engine_args: dict[str, Any] | None = None,
    nodes: NodeGroup | None = None,
) -> tuple[SglangEngine, list[str]]:
    """An SglangEngine started on ``fake`` (``sglang.Engine(**kwargs)`` returns it, the kwargs kept in
    ``fake.kwargs``), and the endpoints its KV event subscribers connect to, recorded instead of connected."""
    module = types.ModuleType("sglang")

    def engine_of(**kwargs: Any) -> FakeSglang:
        fake.kwargs = kwargs  # type: ignore[attr-defined]
        return fake

    module.Engine = engine_of  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang", module)
    endpoints: list[str] = []

    class Subscriber:
        def __init__(self, endpoint: str, topic: str, on_batch: Any) -> None:
            endpoints.append(endpoint)

        def close(self) -> None:
            pass

    monkeypatch.setattr("engines.sglang.engine.ZmqSubscriber", Subscriber)
    engine = SglangEngine(Path("/m"), GpuPlacement(), engine_args or {}, nodes)
    await engine.start()
    return engine, endpoints


def started_engine(fake: FakeSglang) -> SglangEngine:
    engine = SglangEngine(Path("/m"), GpuPlacement(), {})
    engine._engine = fake
    engine._aborts = Aborts(fake, first_wait_s=0)
    return engine


async def test_a_stream_yields_new_tokens_with_cached_tokens_first_and_the_finish_reason_last() -> None:
    fake = FakeSglang(
        [chunk([5], 1, cached_tokens=2), chunk([5, 6], 2), chunk([5, 6, 7], 3, {"type": "length", "length": 3})]
    )
    outputs = [out async for out in started_engine(fake).generate(request(), RequestContext("r1"))]
    assert [out.token_ids for out in outputs] == [[5], [6], [7]]
    assert outputs[0].cached_tokens == 2
    assert outputs[-1].finish_reason == "length"
    assert fake.calls[0]["input_ids"] == [1, 2, 3] and fake.calls[0]["stream"] is True
    assert fake.aborted == []


async def test_a_consumer_that_stops_early_aborts_the_request_in_sglang() -> None:
    fake = FakeSglang([chunk([5], 1), chunk([5, 6], 2), chunk([5, 6, 7], 3)])
    stream = cast(AsyncGenerator[EngineOutput], started_engine(fake).generate(request(), RequestContext("r1")))
    assert (await anext(stream)).token_ids == [5]
    await stream.aclose()
    assert fake.aborted == [fake.calls[0]["rid"]]


async def test_a_stopped_context_aborts_the_request_at_the_next_chunk() -> None:
    fake = FakeSglang([chunk([5], 1), chunk([5, 6], 2), chunk([5, 6, 7], 3)])
    context = RequestContext("r1")
    outputs = []
    async for out in started_engine(fake).generate(request(), context):
        outputs.append(out)
        context.stop()
    assert len(outputs) == 1 and fake.aborted == [fake.calls[0]["rid"]]


class LoadSnapshot(msgspec.Struct, kw_only=True):
    """The fields Flotilla reads of SGLang's ``LoadSnapshot`` (sglang/srt/managers/load_snapshot.py in
    0.5.15; SGLang itself does not import without a CUDA build of torch)."""

    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    max_total_num_tokens: int = 0
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0


RANK0 = LoadSnapshot(
    num_running_reqs=3, num_waiting_reqs=2, num_used_tokens=1000, max_total_num_tokens=16000, token_usage=0.0625,
    cache_hit_rate=0.5,
)  # fmt: skip
RANK1 = LoadSnapshot(
    dp_rank=1, num_running_reqs=1, num_used_tokens=16, max_total_num_tokens=16000, token_usage=0.001, cache_hit_rate=0.1
)


def test_attention_dp_ranks_report_their_own_load_from_sglangs_snapshots() -> None:
    first, second = load_reports([RANK1, RANK0], page_size=16, active=9, per_rank=True)
    assert (first.dp_rank, first.running, first.waiting, first.active_requests) == (0, 3, 2, 5)
    assert (first.kv_active_blocks, first.kv_total_blocks, first.kv_usage, first.prefix_hit_rate) == (
        63,
        1000,
        0.0625,
        0.5,
    )
    assert (second.dp_rank, second.running, second.kv_active_blocks, second.prefix_hit_rate) == (1, 1, 1, 0.1)


def test_plain_dp_replicas_report_as_one_instance_and_odd_values_are_kept_in_bounds() -> None:
    [merged] = load_reports([RANK0, RANK1], page_size=16, active=9, per_rank=False)
    assert (merged.dp_rank, merged.running, merged.waiting, merged.kv_active_blocks) == (0, 4, 2, 64)
    assert merged.kv_total_blocks == 2000 and merged.kv_usage == 0.0625
    assert merged.prefix_hit_rate == pytest.approx(0.3)
    [odd] = load_reports(
        [LoadSnapshot(token_usage=float("nan"), cache_hit_rate=1.5)], page_size=16, active=0, per_rank=False
    )
    assert odd.kv_usage is None and odd.prefix_hit_rate == 1.0 and odd.kv_total_blocks is None


class SnapshotReader:
    def __init__(self, snapshots: list[LoadSnapshot] | Exception) -> None:
        self.snapshots = snapshots

    def read_all(self) -> list[LoadSnapshot]:
        if isinstance(self.snapshots, Exception):
            raise self.snapshots
        return self.snapshots


def test_the_worker_reports_sglangs_snapshots_or_its_own_count_until_there_are_some() -> None:
    fake = FakeSglang([])
    engine = started_engine(fake)
    assert [(r.active_requests, r.running) for r in engine.load()] == [(0, None)]  # no reader: the count
    fake.tokenizer_manager = SimpleNamespace(load_snapshot_reader=SnapshotReader([]))  # type: ignore[attr-defined]
    assert [(r.active_requests, r.running) for r in engine.load()] == [(0, None)]  # nothing published yet
    fake.tokenizer_manager.load_snapshot_reader.snapshots = [RANK0]  # type: ignore[attr-defined]
    assert [(r.active_requests, r.running, r.kv_usage) for r in engine.load()] == [(5, 3, 0.0625)]
    fake.tokenizer_manager.load_snapshot_reader.snapshots = OSError("torn")  # type: ignore[attr-defined]
    assert [r.running for r in engine.load()] == [None]


def test_the_engine_module_imports_and_builds_without_sglang() -> None:
    engine = SglangEngine(Path("/m"), GpuPlacement(), {"page_size": 32})
    assert engine.kind == "token" and engine.block_size == 32


# --- KV events -------------------------------------------------------------------------------------------

TOKENS = list(range(50, 82))  # two pages of 16


def test_sglangs_stored_removed_and_cleared_events_become_flotillas() -> None:
    names = EngineBlockNames(16)
    batch = decode_message(
        zmq_frames(
            BlockStoredSg(block_hashes=[-3, 44], parent_block_hash=None, token_ids=TOKENS, block_size=16, lora_id=None),
            BlockRemovedSg(block_hashes=[44]),
            AllBlocksClearedSg(),
        )
    )
    flotilla = sequence_block_hashes(TOKENS, 16)
    assert translate_batch(batch, names) == [
        BlockStored(block_hashes=flotilla, parent_hash=None),
        BlockRemoved(block_hashes=[flotilla[1]]),
        AllCleared(),
    ]


def test_a_stored_event_chains_from_an_earlier_one_and_keeps_its_lora_id() -> None:
    names = EngineBlockNames(16)
    first = BlockStoredSg(block_hashes=[1], parent_block_hash=None, token_ids=TOKENS[:16], block_size=16, lora_id=None)
    second = BlockStoredSg(block_hashes=[2], parent_block_hash=1, token_ids=TOKENS[16:], block_size=16, lora_id=4)
    events = translate_batch(decode_message(zmq_frames(first, second)), names)
    flotilla = sequence_block_hashes(TOKENS, 16)
    assert events[1] == BlockStored(block_hashes=[flotilla[1]], parent_hash=flotilla[0], lora_id=4)


def test_events_of_another_page_size_or_unknown_parents_are_skipped() -> None:
    names = EngineBlockNames(16)
    other_size = BlockStoredSg(
        block_hashes=[1], parent_block_hash=None, token_ids=TOKENS[:8], block_size=8, lora_id=None
    )
    orphan = BlockStoredSg(block_hashes=[2], parent_block_hash=99, token_ids=TOKENS[:16], block_size=16, lora_id=None)
    assert (
        translate_batch(decode_message(zmq_frames(other_size, orphan, BlockRemovedSg(block_hashes=[5]))), names) == []
    )


def test_a_trailing_medium_field_is_read_as_the_tier() -> None:
    names = EngineBlockNames(16)
    event = ["BlockStored", [1], None, TOKENS[:16], 16, None, "CPU"]
    events = translate_batch([0.0, [event]], names)
    assert isinstance(events[0], BlockStored) and events[0].medium == "cpu"


def test_the_hierarchical_caches_backups_evictions_and_storage_writes_are_tracked_per_tier() -> None:
    # The events SGLang's HiRadixCache sends (medium after lora_id): a page computed on the GPU, backed up to
    # host memory (CPU_TIER1, the GPU keeps its copy), evicted from the GPU, written to the storage backend
    # (CPU_TIER2), then evicted from host memory.
    names = EngineBlockNames(16)
    page = TOKENS[:16]
    batch = [
        0.0,
        [
            ["BlockStored", [7], None, page, 16, None, "GPU"],
            ["BlockStored", [7], None, page, 16, None, "CPU_TIER1"],
            ["BlockRemoved", [7], "GPU"],
            ["BlockStored", [7], None, page, 16, None, "CPU_TIER2"],
            ["BlockRemoved", [7], "CPU_TIER1"],
        ],
    ]
    name = sequence_block_hashes(page, 16)
    assert translate_batch(batch, names) == [
        BlockStored(block_hashes=name),
        BlockStored(block_hashes=name, medium="cpu"),
        BlockRemoved(block_hashes=name),
        BlockStored(block_hashes=name, medium="disk"),
        BlockRemoved(block_hashes=name, medium="cpu"),
    ]
    assert names.state() == [BlockStored(block_hashes=name, medium="disk")]


@pytest.mark.parametrize(
    ("medium", "tier"), [("GPU", None), ("CPU_PINNED", "cpu"), ("DISK", "disk"), ("EXTERNAL", "external")]
)
def test_each_of_sglangs_storage_media_is_its_own_tier(medium: str, tier: str | None) -> None:
    """SGLang's storage media (``StorageMedium``: GPU, CPU_PINNED, DISK, EXTERNAL, as its KV event sources name
    them), each on Flotilla's tier of the same place; none is read as the GPU but the GPU."""
    names = EngineBlockNames(16)
    events = translate_batch([0.0, [["BlockStored", [7], None, TOKENS[:16], 16, None, medium]]], names)
    assert events == [BlockStored(block_hashes=sequence_block_hashes(TOKENS[:16], 16), medium=tier)]  # type: ignore[arg-type]


def test_a_tier_name_sglang_may_add_later_is_external_not_the_gpu() -> None:
    names = EngineBlockNames(16)
    events = translate_batch([0.0, [["BlockStored", [7], None, TOKENS[:16], 16, None, "CPU_TIER3"]]], names)
    assert events == [BlockStored(block_hashes=sequence_block_hashes(TOKENS[:16], 16), medium="external")]
    assert len(names) == 0  # the GPU holds nothing


def test_a_message_that_is_not_three_frames_or_not_msgpack_is_refused() -> None:
    with pytest.raises(ValueError, match="3 frames"):
        decode_message([b"x"])
    with pytest.raises(ValueError, match="msgpack"):
        decode_message([b"t", b"\0" * 8, b"\xc1"])


class ListSink:
    def __init__(self) -> None:
        self.published: list[tuple[int, list[Any]]] = []

    def publish(self, dp_rank: int, events: list[Any]) -> None:
        self.published.append((dp_rank, events))


def test_a_subscribed_batch_is_published_renamed_and_kept_for_a_state_request() -> None:
    engine = SglangEngine(Path("/m"), GpuPlacement(), {})
    sink = ListSink()
    engine.attach_kv_events(sink)
    stored = BlockStoredSg(block_hashes=[7, 8], parent_block_hash=None, token_ids=TOKENS, block_size=16, lora_id=None)
    engine._publish_batch(0, decode_message(zmq_frames(stored)))
    named = sequence_block_hashes(TOKENS, 16)
    assert sink.published == [(0, [BlockStored(block_hashes=named)])]
    assert engine.cache_state(0) == {
        0: [BlockStored(block_hashes=[named[0]]), BlockStored(block_hashes=[named[1]], parent_hash=named[0])]
    }
    assert engine.cache_state(1) == {}


def test_every_dp_rank_of_this_node_is_a_cache_of_its_own_with_attention_dp_or_without() -> None:
    assert local_dp_ranks({}) == range(1)
    # Plain DP: each replica a whole engine with its cache, publishing on its own port (SGLang's
    # select_kv_publisher_dp_rank: the replica's dp rank); attention DP: each attention rank.
    assert local_dp_ranks({"dp_size": 4}) == range(4)
    assert local_dp_ranks({"dp_size": 4, "enable_dp_attention": True}) == range(4)
    # Across nodes, this node's share, as SGLang lays the ranks out (dp_size // nnodes per node, in node order).
    leader = LeaderAddress("10.0.0.1", 29500)
    dp = {"dp_size": 4, "enable_dp_attention": True}
    assert local_dp_ranks(dp, NodeGroup(num_nodes=2, leader=leader)) == range(2)
    second = NodeGroup(num_nodes=2, node_rank=1, leader=leader)
    assert local_dp_ranks(dp, second) == range(2, 4)


async def test_each_local_dp_rank_is_subscribed_to_and_reported_as_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's scheduler of each plain-DP replica publishes on the configured port plus its dp rank
    (python/sglang/srt/disaggregation/kv_events.py, ``ZmqEventPublisher.offset_endpoint_port``)."""
    fake = FakeSglang([])
    engine, endpoints = await start_on_fake(monkeypatch, fake, {"dp_size": 2})
    base = int(json.loads(fake.kwargs["kv_events_config"])["endpoint"].rpartition(":")[2])  # type: ignore[attr-defined]
    assert endpoints == [f"tcp://*:{base}", f"tcp://*:{base + 1}"]
    sink = ListSink()
    engine.attach_kv_events(sink)
    stored = BlockStoredSg(block_hashes=[7], parent_block_hash=None, token_ids=TOKENS[:16], block_size=16, lora_id=None)
    engine._publish_batch(1, decode_message(zmq_frames(stored)))
    assert sink.published == [(1, [BlockStored(block_hashes=sequence_block_hashes(TOKENS[:16], 16))])]
    fake.tokenizer_manager.load_snapshot_reader = SnapshotReader([RANK0, RANK1])  # type: ignore[attr-defined]
    assert [report.dp_rank for report in engine.load()] == [0, 1]
    await engine.close()


def test_each_dp_rank_publishes_on_the_port_after_the_previous_ranks() -> None:
    assert rank_endpoints(6000, range(3)) == {0: "tcp://*:6000", 1: "tcp://*:6001", 2: "tcp://*:6002"}
    assert 0 < free_tcp_ports(3) < 65534


def test_a_ranks_batch_is_published_as_that_rank_with_its_own_names() -> None:
    engine = SglangEngine(Path("/m"), GpuPlacement(), {"dp_size": 2, "enable_dp_attention": True})
    sink = ListSink()
    engine.attach_kv_events(sink)
    stored = BlockStoredSg(block_hashes=[7], parent_block_hash=None, token_ids=TOKENS[:16], block_size=16, lora_id=None)
    engine._publish_batch(1, decode_message(zmq_frames(stored)))
    named = sequence_block_hashes(TOKENS[:16], 16)
    assert sink.published == [(1, [BlockStored(block_hashes=named)])]
    assert engine.cache_state(None) == {0: [], 1: [BlockStored(block_hashes=named)]}


async def test_an_abort_sglang_did_on_its_own_is_an_engine_error_with_its_message() -> None:
    refused = {"type": "abort", "message": "The input (9000 tokens) is longer than the model's context length"}
    fake = FakeSglang([chunk([], 0, refused)])
    with pytest.raises(EngineError, match=r"SGLang aborted the request: The input \(9000 tokens\) is longer"):
        async for _ in started_engine(fake).generate(request(), RequestContext("r1")):
            pass
    assert fake.aborted == []
