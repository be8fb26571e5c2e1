"""SGLang's KV events of the dp ranks on other nodes, relayed to the leader's worker over NATS.

With attention DP across nodes (``--num-nodes N``, ``dp_size`` a multiple of N, ``enable_dp_attention``) each dp
rank's scheduler has a KV cache of its own and publishes its events on its own node, on the port of
``kv_events_config`` plus its rank (SGLang's ``select_kv_publisher_dp_rank`` and
``ZmqEventPublisher.offset_endpoint_port``), ``dp_size // nnodes`` ranks per node in node order (Dynamo's
``init_kv_event_publish``). Only the leader's worker registers and publishes KV events for routers, so a rank
above 0 (launcher/follower.py) subscribes to its own ranks' publishers and relays each message's payload, undecoded,
on NATS (``DpRelay``: the follower has no event loop, so the relay runs one in a thread of its own); the leader's
engine subscribes to the other nodes' ranks (``RelayListener``) and takes each payload as a batch of that rank,
named, kept and published as its own ranks' are (engines/sglang/engine.py).

The subject is one both sides compute from what both are given: the pipeline's ``dyn://`` address (namespace,
component) and ``--leader-addr`` (``relay_subject``). A message for a rank that does not run on another node of
the group is refused, and a payload that does not decode is dropped (both logged, rate-limited).

NATS lost: the relay's client reconnects for ever (runtime/cluster/nats_connection.py); what it relays meanwhile
waits in nats-py's buffer, and what overflows it is lost. The follower serves on either way.
"""

import asyncio
import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Collection
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from engines.shared.node_group import LeaderAddress
from engines.shared.zmq_kv_events import ZmqSubscriber, decode_payload, message_payload
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.nats_connection import close_nats, connect_nats, consume
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

#: Refused or undecodable relayed messages, and relays NATS did not take, are logged at most this often.
REPORT_S = 10.0
#: Payloads waiting for the relay's NATS client; beyond it the newest are dropped (logged).
RELAY_QUEUE = 10_000
#: How long ``DpRelay.close()`` waits for its thread.
CLOSE_WAIT_S = 5.0


def relay_subject(address: EndpointAddress, leader: LeaderAddress, rank: int | str) -> str:
    """The NATS subject of dp rank ``rank``'s relayed events (``"*"``: every rank's) for the instance whose leader
    is at ``leader``, in ``address``'s component. The leader's address is hashed: its dots and colons are no
    subject token."""
    group = hashlib.sha256(str(leader).encode()).hexdigest()[:16]
    return f"flotilla.{address.namespace}.{address.component}.sglang_relay.{group}.{rank}"


class DpRelay:
    """Relays the KV event messages of this node's dp ranks (``endpoints``: rank -> SGLang's publisher) to the
    leader's worker, on ``relay_subject``. ``start()`` returns at once; the relay connects to NATS (``servers``)
    in its thread, retrying for as long as it takes, and relays from then on; ``close()`` stops it."""

    def __init__(
        self,
        servers: list[str],
        address: EndpointAddress,
        leader: LeaderAddress,
        endpoints: dict[int, str],
        topic: str,
        *,
        name: str = "sglang-relay",
    ) -> None:
        self._servers = servers
        self._subjects = {rank: relay_subject(address, leader, rank) for rank in endpoints}
        self._endpoints = endpoints
        self._topic = topic
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._losses = RateLimitedLog(log, period_s=REPORT_S, held_level=logging.DEBUG)
        #: Set once its NATS client is connected and its subscribers started (for tests and logs).
        self.relaying = threading.Event()
        #: Payloads handed to NATS (a counter, for tests).
        self.relayed = 0

    def start(self) -> None:
        # Made here, before the thread runs the loop: close() may come before the thread has started it.
        self._loop = asyncio.new_event_loop()
        self._task = self._loop.create_task(self._relay(), name=self._name)
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop relaying, close the subscribers and the NATS connection (within ``CLOSE_WAIT_S``)."""
        thread, task, loop = self._thread, self._task, self._loop
        if thread is None or task is None or loop is None:
            return
        if thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(task.cancel)
            thread.join(CLOSE_WAIT_S)
            if thread.is_alive():
                log.warning("the KV event relay did not stop within %.0f s; the process's exit ends it", CLOSE_WAIT_S)
        self._thread = None

    def _run(self) -> None:
        loop, task = self._loop, self._task
        assert loop is not None and task is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            pass
        except Exception:  # never the follower's end: the leader's instance serves without these events
            log.exception("the KV event relay to the leader stopped; this node's ranks' events are not relayed")
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _relay(self) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue(RELAY_QUEUE)

        def enqueue(rank: int, payload: bytes) -> None:
            try:
                queue.put_nowait((rank, payload))
            except asyncio.QueueFull:
                self._losses.warning(f"KV events of dp rank {rank} dropped: the relay to the leader is behind")

        # Waits (and warns, naming the servers) until NATS answers: the follower serves meanwhile.
        nc = await connect_nats(self._servers, name=self._name)
        subscribers: list[ZmqSubscriber] = []
        try:
            for rank, endpoint in self._endpoints.items():

                def on_payload(payload: bytes, rank: int = rank) -> None:  # in the subscriber's thread
                    loop.call_soon_threadsafe(enqueue, rank, payload)

                subscribers.append(ZmqSubscriber(endpoint, self._topic, on_payload, decode=message_payload))
            log.info(
                "relaying the KV events of dp rank(s) %s to the leader over NATS (%s)",
                ", ".join(map(str, self._endpoints)), ", ".join(self._servers),
            )  # fmt: skip
            self.relaying.set()
            while True:
                rank, payload = await queue.get()
                try:
                    await nc.publish(self._subjects[rank], payload)
                    self.relayed += 1
                except nats.errors.Error as exc:  # a full buffer while NATS is away: this batch is lost
                    self._losses.warning(f"a KV event batch of dp rank {rank} was not relayed: {exc!r}")
        finally:
            for subscriber in subscribers:
                subscriber.close()
            await close_nats(nc)


class RelayListener:
    """The leader's side: hears the relayed batches of ``ranks`` (those on the other nodes) and gives each to
    ``on_batch(rank, batch)``, decoded, on the event loop. ``run()`` until cancelled."""

    def __init__(
        self,
        nc: NATS,
        address: EndpointAddress,
        leader: LeaderAddress,
        ranks: Collection[int],
        on_batch: Callable[[int, Any], None],
    ) -> None:
        self._nc = nc
        self.subject = relay_subject(address, leader, "*")
        self._ranks = frozenset(ranks)
        self._on_batch = on_batch
        self._refusals = RateLimitedLog(log, period_s=REPORT_S, held_level=logging.DEBUG)
        #: Set once subscribed (nats-py subscribes again by itself after a reconnection).
        self.subscribed = asyncio.Event()
        #: Messages refused or dropped (a counter, for tests).
        self.refused = 0

    async def run(self) -> None:
        await consume(self._nc, self.subject, self._handle, subscribed=self.subscribed)

    def _handle(self, message: Msg) -> None:
        token = message.subject.rpartition(".")[2]
        rank = int(token) if token.isdigit() else None
        if rank not in self._ranks:
            # A rank of the leader's own node, or none of this group's: believed of no sender.
            self._refuse(f"relayed KV events on {message.subject} refused: no dp rank of another node of this group")
            return
        try:
            batch = decode_payload(message.data)
        except ValueError as exc:
            self._refuse(f"relayed KV events of dp rank {rank} dropped: {exc}")
            return
        self._on_batch(rank, batch)

    def _refuse(self, message: str) -> None:
        self.refused += 1
        self._refusals.warning(message)
