"""KV-aware routing end to end: an ingress in ``--router-mode kv`` over real etcd and NATS.

The workers are ``out=echo_core`` processes, which publish no KV events (and register so); the tests
publish events on their behalf, as a KV-publishing engine would, and check where the ingress sends
requests (the ``x-flotilla-instance`` header). Asks for a worker's whole cache state are tested with
mockers, which answer them (test_kv_routing_mocker.py).
"""

import asyncio
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from launcher.cli import exit_code, parse_run_options
from launcher.run_parser import build_run_parser
from runtime.cluster.nats_connection import flush
from runtime.errors import ConfigError
from runtime.fleet_contract.router_settings import DEFAULT_QUEUED_PREFILL_WEIGHT
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored, KvEventBatch
from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.distributed.kv_pool import (
    ADDRESS,
    MODEL,
    complete,
    prefix_tokens,
    registered_block_size,
    start_pool,
    unique_tokens,
)


def publish(nats_url: str, *batches: KvEventBatch) -> None:
    """Publish KV event batches as the workers would (msgpack on the component's kv_events subject)."""

    async def send() -> None:
        nc = NATS()
        await nc.connect(nats_url)
        for batch in batches:
            await nc.publish(ADDRESS.kv_events_subject(), msgspec.msgpack.encode(batch))
        await flush(nc)
        await nc.close()

    asyncio.run(send())


class StateResponder:
    """Answers one worker's ``kv_state`` asks with a fixed cache, from a thread of its own."""

    def __init__(self, nats_url: str, instance_id: int, blocks: list[int]) -> None:
        self.nats_url = nats_url
        self.instance_id = instance_id
        self.blocks = blocks
        self.asked = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> "StateResponder":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._nc.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _serve(self) -> None:
        self._nc = NATS()
        await self._nc.connect(self.nats_url)

        async def answer(message: Msg) -> None:
            self.asked += 1
            state = KvEventBatch(instance_id=self.instance_id, event_id=0, events=[BlockStored(self.blocks)])
            await message.respond(msgspec.msgpack.encode(state))

        await self._nc.subscribe(ADDRESS.kv_state_subject(self.instance_id), cb=answer)
        await flush(self._nc)


def test_requests_sharing_a_long_prefix_go_to_the_worker_holding_it(cluster: Cluster) -> None:
    ingress, pool = start_pool(cluster, "--router-mode", "kv")
    block_size = registered_block_size(cluster.etcd)
    holder = pool[1]
    prefix = prefix_tokens(8, block_size)
    hashes = sequence_block_hashes(prefix, block_size)
    publish(
        cluster.nats.url,
        KvEventBatch(instance_id=int(holder.instance_id, 16), event_id=1, events=[BlockStored(hashes)]),
    )

    def suffixed(n: int) -> list[int]:
        return prefix + [500 + n] * block_size

    wait_until(lambda: complete(ingress, suffixed(0)) == holder.instance_id, 15, "the prefix never reached its holder")
    assert [complete(ingress, suffixed(n)) for n in range(1, 11)] == [holder.instance_id] * 10
    # Requests without that prefix still go anywhere: not everything lands on the holder.
    others = Counter(complete(ingress, unique_tokens(4 * block_size)) for _ in range(30))
    assert len(others) > 1


def test_load_still_spreads_when_every_request_shares_one_prefix(cluster: Cluster) -> None:
    # Each request streams 100 tokens at 10 ms: all 12 are running at once. Their answers fill more blocks
    # of their own than the 8 of prefill the holder's cache saves, so from its third request on, the
    # holder costs more than an idle worker (running requests share the prefix's blocks, as a worker
    # holds them, so short answers would rightly pile onto the holder).
    ingress, pool = start_pool(cluster, "--router-mode", "kv", delay_ms=10)
    block_size = registered_block_size(cluster.etcd)
    holder = pool[0]
    prefix = prefix_tokens(8, block_size)
    hashes = sequence_block_hashes(prefix, block_size)
    publish(
        cluster.nats.url,
        KvEventBatch(instance_id=int(holder.instance_id, 16), event_id=1, events=[BlockStored(hashes)]),
    )
    wait_until(lambda: complete(ingress, [*prefix, 7]) == holder.instance_id, 15, "the prefix never reached its holder")

    with ThreadPoolExecutor(12) as threads:
        served = Counter(threads.map(lambda n: complete(ingress, [*prefix, 100 + n], max_tokens=100), range(12)))
    assert set(served) == {worker.instance_id for worker in pool}, served
    assert max(served.values()) <= 6, served
    assert served[holder.instance_id] == max(served.values()), served


def test_without_kv_events_requests_follow_the_router_s_own_earlier_decisions(cluster: Cluster) -> None:
    ingress, _ = start_pool(cluster, "--router-mode", "kv", "--use-kv-events", "false")
    block_size = registered_block_size(cluster.etcd)
    prefix = prefix_tokens(8, block_size, start=3000)
    first = complete(ingress, [*prefix, 1])
    assert [complete(ingress, [*prefix, n]) for n in range(2, 12)] == [first] * 10


def test_workers_that_publish_no_kv_events_are_never_asked_for_a_state_and_their_caches_are_predicted(
    cluster: Cluster,
) -> None:
    # echo_core registers that it publishes no KV events (as llama.cpp does): a KV router asks it for no
    # cache state (test_kv_routing_mocker.py has the asks of workers that do) and predicts its cache from
    # where it sent requests, rather than routing it on load alone.
    workers = cluster.start_workers(3, f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL)
    prefix = prefix_tokens(8, 16, start=6000)
    with StateResponder(cluster.nats.url, int(workers[2].instance_id, 16), sequence_block_hashes(prefix, 16)) as state:
        ingress = cluster.start_ingress("--router-mode", "kv")
        wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
        first = complete(ingress, [*prefix, 1])
        # On load alone each of these would go to any of the three (they finish at once).
        assert [complete(ingress, [*prefix, n]) for n in range(2, 8)] == [first] * 6
        assert state.asked == 0


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--router-mode", "kvv", "argument --router-mode: invalid choice: 'kvv'"),
        ("--kv-overlap-score-weight", "-1", "argument --kv-overlap-score-weight: -1.0 must be a finite number"),
        ("--kv-queued-prefill-weight", "1.5", "argument --kv-queued-prefill-weight: 1.5 must be between 0 and 1"),
        ("--kv-queued-prefill-weight", "-0.5", "argument --kv-queued-prefill-weight: -0.5 must be between 0 and 1"),
        ("--router-temperature", "hot", "argument --router-temperature: 'hot' is not a number"),
        ("--use-kv-events", "maybe", "argument --use-kv-events: 'maybe' is not a boolean"),
        ("--router-ttl", "0", "argument --router-ttl: 0.0 must be a positive number of seconds"),
    ],
)
def test_a_bad_router_flag_exits_2_naming_it(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_run_parser().parse_intermixed_args(["in=http", "out=dyn", flag, value])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_router_variable_exits_2_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_USE_KV_EVENTS", "perhaps")
    parser = build_run_parser()
    with pytest.raises(ConfigError, match="FLOTILLA_USE_KV_EVENTS: 'perhaps' is not a boolean") as refused:
        parse_run_options(parser, parser.parse_intermixed_args(["in=http", "out=dyn"]))
    assert exit_code(refused.value) == 2


def test_the_router_flags_reach_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_ROUTER_TTL_S", "30")
    parser = build_run_parser()
    args = ["in=http", "out=dyn", "--router-mode", "kv", "--kv-overlap-score-weight", "2.5"]
    args += ["--router-temperature", "0.7", "--use-kv-events", "false", "--kv-queued-prefill-weight", "0.25"]
    options = parse_run_options(parser, parser.parse_intermixed_args(args))
    assert (options.router_mode, options.kv_overlap_score_weight, options.router_temperature) == ("kv", 2.5, 0.7)
    assert options.kv_queued_prefill_weight == 0.25
    plain = parse_run_options(parser, parser.parse_intermixed_args(["in=http", "out=dyn", "--router-mode", "kv"]))
    assert plain.kv_queued_prefill_weight == DEFAULT_QUEUED_PREFILL_WEIGHT == 0.5
    assert (options.use_kv_events, options.router_ttl_s) == (False, 30.0)
