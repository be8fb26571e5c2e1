"""Helpers of the KV-routing tests: a pool of workers behind an ingress, prompts, and NATS as a router hears it.

Which worker served a request is the ingress's own answer (the ``x-flotilla-instance`` response
header); whether its cache was hit is the engine's (``usage.prompt_tokens_details.cached_tokens``).
What the workers publish (KV event batches, load reports, answers to cache-state asks) is heard by a
``NatsListener`` on its own NATS connection, as a router hears it.
"""

import asyncio
import base64
import itertools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.discovery import MODELS_PREFIX
from runtime.cluster.nats_connection import flush
from runtime.endpoint import ModelEntry
from runtime.kv.events import BlockStored, KvEventBatch, KvStateRequest, WorkerLoad
from tests.distributed.cluster import Cluster, Worker, served_models, wait_until
from tests.infra import EtcdServer
from tests.servers import Server

MODEL = "llm"
ADDRESS = EndpointAddress(MODEL)

# Far above the prefixes the tests build by hand (token ids from 1000), below the default model's
# vocabulary (SmolLM2: 49152).
_fresh = itertools.count(20_000)


def prefix_tokens(blocks: int, block_size: int, start: int = 1000) -> list[int]:
    """``blocks`` full blocks of distinct tokens from ``start`` on: a prefix no other start shares."""
    return list(range(start, start + blocks * block_size))


def fresh_prefix(blocks: int, block_size: int) -> list[int]:
    """``blocks`` full blocks that start with a token no other call starts with: a prefix nobody holds yet.

    Block hashes are chained, so a first token of its own makes every block of the prefix its own.
    """
    return [next(_fresh), *range(1000, 1000 + blocks * block_size - 1)]


def unique_tokens(count: int) -> list[int]:
    """Tokens no other call returns as its first: a request that starts with them has its own first block."""
    first = next(_fresh)
    return [first] * count


@dataclass(frozen=True)
class Completion:
    """Who served a completion, and how much of its prompt that worker had cached (None: not reported)."""

    instance: str  # hex instance id, from the x-flotilla-instance header
    cached_tokens: int | None


def send(ingress: Server, tokens: list[int], max_tokens: int = 2) -> Completion:
    """Send a completion of the token ids ``tokens``; AssertionError unless it succeeds."""
    body = {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens}
    reply = httpx.post(ingress.base_url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    details = reply.json()["usage"].get("prompt_tokens_details") or {}
    return Completion(reply.headers["x-flotilla-instance"], details.get("cached_tokens"))


def complete(ingress: Server, tokens: list[int], max_tokens: int = 2) -> str:
    """Send a completion of ``tokens``; returns the hex id of the instance that served it."""
    return send(ingress, tokens, max_tokens).instance


def registered_block_size(etcd: EtcdServer) -> int:
    """The KV block size in the model card the workers registered (over etcd's JSON API)."""

    def encode(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    # The range end is the prefix with its last byte incremented: every key that starts with it.
    body = {"key": encode(MODELS_PREFIX), "range_end": encode(MODELS_PREFIX[:-1] + chr(ord(MODELS_PREFIX[-1]) + 1))}
    kvs = httpx.post(etcd.endpoint + "/v3/kv/range", json=body, timeout=5).json()["kvs"]
    entry = msgspec.json.decode(base64.b64decode(kvs[0]["value"]), type=ModelEntry)
    return entry.card.kv_cache_block_size


def mocker_settings(directory: Path, **settings: Any) -> tuple[str, ...]:
    """The worker arguments of ``out=mocker`` with ``settings`` (Dynamo's key names) in a file in ``directory``."""
    path = directory / "mocker.json"
    path.write_text(json.dumps(settings))
    return ("out=mocker", "--extra-engine-args", str(path))


def start_workers(cluster: Cluster, count: int, *engine_args: str, delay_ms: int = 0) -> list[Worker]:
    """``count`` workers of MODEL (``engine_args``: ``out=…`` and its flags), each registered when returned."""
    return [
        cluster.start_worker(f"dyn://{MODEL}", *engine_args, "--model-name", MODEL, delay_ms=delay_ms)
        for _ in range(count)
    ]


def wait_for_every_worker(ingress: Server, pool: list[Worker]) -> None:
    """Return once each worker of ``pool`` has served a request through ``ingress`` (AssertionError after 30 s).

    Requests of tokens no worker holds: with nothing cached there, a KV router breaks its ties at random.
    """
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    seen: set[str] = set()
    wanted = {worker.instance_id for worker in pool}

    def every_worker_served() -> bool:
        seen.add(complete(ingress, unique_tokens(4)))
        return seen >= wanted

    wait_until(every_worker_served, 30, "some worker never got a request")


def start_pool(
    cluster: Cluster,
    *ingress_args: str,
    engine_args: tuple[str, ...] = ("out=echo_core",),
    workers: int = 3,
    delay_ms: int = 0,
) -> tuple[Server, list[Worker]]:
    """An ingress with ``ingress_args`` and ``workers`` workers of ``engine_args``, every one of them routed to."""
    ingress = cluster.start_ingress(*ingress_args)
    pool = start_workers(cluster, workers, *engine_args, delay_ms=delay_ms)
    wait_for_every_worker(ingress, pool)
    return ingress, pool


def stored_hashes(batches: list[KvEventBatch], instance_id: int, dp_rank: int = 0) -> list[int]:
    """The block hashes ``batches`` say worker (``instance_id``, ``dp_rank``) stored, in order."""
    return [
        block_hash
        for batch in batches
        if (batch.instance_id, batch.dp_rank) == (instance_id, dp_rank)
        for event in batch.events
        if isinstance(event, BlockStored)
        for block_hash in event.block_hashes
    ]


class NatsListener:
    """Records what the workers of ADDRESS publish on NATS, as a router hears it, on a thread of its own.

    ``batches`` and ``loads`` are the KV event batches and load reports, in arrival order. With
    ``watch_state_asks``, it also sees every ask for a worker's cache state (``kv_state`` subjects) and
    the answer sent back to the asker (by listening on every inbox: use it where little else flows).
    """

    def __init__(self, nats_url: str, *, watch_state_asks: bool = False) -> None:
        self._url = nats_url
        self._watch_state_asks = watch_state_asks
        self.batches: list[KvEventBatch] = []
        self.loads: list[WorkerLoad] = []
        self._asks: dict[str, int] = {}  # reply subject of an ask -> the instance asked
        self._answered: set[str] = set()  # reply subjects an answer went to
        self._changed = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nats listener", daemon=True)
        self._nc = NATS()

    def __enter__(self) -> "NatsListener":
        self._thread.start()
        self._call(self._subscribe())
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._call(self._nc.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def wait_for(self, condition: Callable[["NatsListener"], bool], timeout: float, message: str) -> None:
        """Return once ``condition(self)`` holds (checked at each message); AssertionError after ``timeout``."""
        with self._changed:
            if not self._changed.wait_for(lambda: condition(self), timeout):
                raise AssertionError(message)

    def wait_for_stored(self, instance: str, hashes: list[int], timeout: float = 10) -> None:
        """Return once worker ``instance`` (hex, rank 0) has published that it stored every block of ``hashes``."""
        wanted = set(hashes)
        self.wait_for(
            lambda seen: wanted <= set(stored_hashes(seen.batches, int(instance, 16))),
            timeout,
            f"worker {instance} did not publish that it stored the prefix",
        )

    def answered_state_asks(self) -> set[int]:
        """The instances that answered an ask for their cache state (needs ``watch_state_asks``)."""
        with self._changed:
            return {instance for reply, instance in self._asks.items() if reply in self._answered}

    def ask_state(self, instance_id: int, dp_rank: int) -> KvEventBatch:
        """The worker's answer to a KvStateRequest for ``dp_rank``."""
        request = msgspec.msgpack.encode(KvStateRequest(dp_rank=dp_rank))
        reply: Msg = self._call(self._nc.request(ADDRESS.kv_state_subject(instance_id), request, timeout=5))
        return msgspec.msgpack.decode(reply.data, type=KvEventBatch)

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=15)

    async def _subscribe(self) -> None:
        await self._nc.connect(self._url)

        async def on_events(message: Msg) -> None:
            self._record(self.batches.append, msgspec.msgpack.decode(message.data, type=KvEventBatch))

        async def on_load(message: Msg) -> None:
            self._record(self.loads.append, msgspec.json.decode(message.data, type=WorkerLoad))

        async def on_ask(message: Msg) -> None:
            instance = int(message.subject.rsplit(".", 1)[1], 16)
            self._record(lambda reply: self._asks.__setitem__(reply, instance), message.reply)

        async def on_answer(message: Msg) -> None:
            self._record(self._answered.add, message.subject)

        await self._nc.subscribe(ADDRESS.kv_events_subject(), cb=on_events)
        await self._nc.subscribe(ADDRESS.load_metrics_subject(), cb=on_load)
        if self._watch_state_asks:
            # Asks and answers come through two subscriptions, each served by its own task: either may
            # be recorded first, so they are matched when asked for, not when they arrive.
            await self._nc.subscribe(ADDRESS.kv_state_subject(0).rsplit(".", 1)[0] + ".*", cb=on_ask)
            await self._nc.subscribe("_INBOX.>", cb=on_answer)
        await flush(self._nc)

    def _record(self, add: Callable[[Any], None], item: Any) -> None:
        with self._changed:
            add(item)
            self._changed.notify_all()
