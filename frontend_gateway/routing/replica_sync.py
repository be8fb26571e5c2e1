"""Router replicas of one model pool tell each other where they sent requests (``--router-replica-sync``).

Each ingress process counts the load its own decisions put on each worker (kv_load.ActiveLoad), and
the workers' reports, which see every process's traffic, come a second late. With several ingress
processes (``--reuse-port``, or replicas on several machines) a hot prefix then draws a herd: every
process sees the worker that holds it idle and sends its share there until the reports catch up.
So, as Dynamo's ``--router-replica-sync`` does, each replica publishes its decisions: when it routes a
request (the worker, the prompt's full block hashes, the tokens to compute and the blocks of its own),
when that request's prefill is done and when it ends; every other replica of the pool applies them to
its ActiveLoad (and to its predicted index when KV events are off), as if it had decided them itself.

What a replica says is believed only about its own requests: they are kept under its replica id, so
no message can touch another replica's entries or this router's; instances outside the pool and
sizes past the bounds below are ignored, and a message that does not decode is counted and ignored.

A replica that dies leaves its entries behind, and so does a lost ``finished``: every replica sends
at least one batch per ``HEARTBEAT_S`` (empty if it has nothing to say), a replica not heard from for
``EXPIRE_AFTER_S`` is forgotten with all its entries, one that closes says so and is forgotten at
once, and every ``RECONCILE_S`` a replica lists the requests it still has in flight, so that the
others drop those whose end they missed (a reconnect to NATS loses what was published meanwhile).
A replica that joins learns the others' requests as they are routed, not those already in flight.

Messages go out in batches: the decisions made while the sender task waited for its turn on the event
loop leave in one message, so a burst costs a few publishes, and an idle pool one heartbeat a second
per replica. A request's prefill done and its end tell the others that a worker has less to do, which
they would learn a second later from the worker's load report anyway: these wait up to ``ENDS_WAIT_S``
for the next decision's message to ride along, rather than cost every replica a message of their own
(on the replayed trace through 4 replicas, 1.1 messages a request instead of 3, with the same TTFT and
hit rate in bench/routing_sim.py, which finds no loss up to 200 ms). Messages are msgpack, a routed
request about 10 bytes per prompt block. A replica that hears no other sends heartbeats only: its
decisions would be news to nobody (one that joins learns only the requests routed after it, whoever
routed them), so a lone ingress pays one message a second. The first heartbeat goes out as the
replica starts, and the others start telling it their decisions once heard.

A decision made in another replica during the last few milliseconds is not known here yet, so each
batch says when its first decision was made and the receiver reports how late they arrive
(``flotilla_router_replica_sync_delay_seconds``). In simulated time (bench/routing_sim.py), four
replicas lose 0.5% of one router's hit rate at 1.5 ms and 2.4% at 20 ms: the sync costs little as long
as the ingress processes have CPU to spare.
"""

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from frontend_gateway.routing.kv_indexer import Worker
from frontend_gateway.routing.kv_load import ActiveLoad
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.nats_connection import consume, flush
from runtime.rate_limited_log import RateLimitedLog
from runtime.supervision import Supervisor

log = logging.getLogger(__name__)

#: A replica sends at least one batch this often; one not heard from for EXPIRE_AFTER_S is forgotten.
HEARTBEAT_S = 1.0
#: How long a prefill done or an end may wait for a decision to go out with (see the module's text).
ENDS_WAIT_S = 0.1
EXPIRE_AFTER_S = 5.0
#: How often a replica lists the requests it has in flight (those missing from the list are dropped).
RECONCILE_S = 10.0
#: Bounds on what one replica may make this router keep (beyond them, messages are malformed).
MAX_REPLICAS = 256
MAX_REQUESTS_PER_REPLICA = 1 << 16
MAX_REQUEST_ID_CHARS = 256
MAX_HASHES = 1 << 15  # a 512k-token prompt in blocks of 16
MAX_EVENTS_PER_BATCH = 4096
MAX_DP_RANK = 1023
#: A batch is cut after this many block hashes, to stay well below NATS's 1 MiB payload limit.
HASHES_PER_BATCH = 40_000
#: Requests in flight past this are not listed (the list would pass the payload limit): no reconcile.
MAX_LISTED = 8192
#: How long ``start`` waits for NATS to confirm the subscription, and ``close`` to say goodbye (NATS may be away).
CONFIRM_TIMEOUT_S = 2.0
GOODBYE_TIMEOUT_S = 1.0
MALFORMED_REPORT_S = 10.0

_RequestId = Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_CHARS)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 30)]


class Routed(msgspec.Struct, frozen=True, array_like=True, tag="r"):
    """The replica routed ``request_id`` to instance ``instance_id``'s rank ``dp_rank`` (ActiveLoad.started)."""

    request_id: _RequestId
    instance_id: Annotated[int, msgspec.Meta(ge=0)]
    dp_rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_DP_RANK)]
    prefill_tokens: _Count
    own_blocks: _Count
    hashes: Annotated[list[int], msgspec.Meta(max_length=MAX_HASHES)]


class PrefillDone(msgspec.Struct, frozen=True, array_like=True, tag="p"):
    request_id: _RequestId


class Finished(msgspec.Struct, frozen=True, array_like=True, tag="f"):
    request_id: _RequestId


SyncEvent = Routed | PrefillDone | Finished


class SyncBatch(msgspec.Struct, frozen=True, kw_only=True):
    """What one replica says at once, in order, on its own subject; an empty batch says it is alive."""

    #: Block hashes of another block size name other blocks: such a batch is ignored.
    block_size: int
    events: Annotated[list[SyncEvent], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)] = []
    #: Every request the replica has in flight, after ``events`` (sent every RECONCILE_S; None otherwise).
    active: Annotated[list[_RequestId], msgspec.Meta(max_length=MAX_REQUESTS_PER_REPLICA)] | None = None
    #: The replica is closing: forget its entries now.
    closing: bool = False
    #: When the replica made the first decision in it (sent it, if none), by its wall clock (seconds since
    #: the epoch; 0: not said): the receiver measures how late the others' decisions reach it, which is
    #: what costs routing quality.
    sent_at: float = 0.0


_decode_batch = msgspec.msgpack.Decoder(SyncBatch).decode
_encode = msgspec.msgpack.Encoder().encode


def sync_subjects(address: EndpointAddress) -> str:
    """The subjects (a wildcard, one per replica) where the router replicas of the pool whose first
    instance serves ``address`` talk."""
    return f"flotilla.{address.namespace}.{address.component}.router_sync.{address.endpoint}.*"


def _replica_of(subject: str) -> str | None:
    """The replica id that ends ``subject``; None for a token that no replica would have sent."""
    replica = subject.rpartition(".")[2]
    if not 0 < len(replica) <= 64 or not all(char in _HEX for char in replica):
        return None
    return replica


_HEX = frozenset("0123456789abcdef")


@dataclass(slots=True)
class _Peer:
    heard_at: float
    requests: set[str] = field(default_factory=set)  # its requests, as keys of ActiveLoad


class ReplicaSync:
    """Publishes this router's decisions and applies the other replicas' to ``load`` (and to the caches it
    predicts)."""

    def __init__(
        self,
        *,
        nc: NATS,
        address: EndpointAddress,
        block_size: int,
        load: ActiveLoad,
        predict: Callable[[Worker, Sequence[int]], None],
        in_pool: Callable[[int], bool],
        enabled: bool = True,
        on_message: Callable[[], None] = lambda: None,
        on_delay: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``in_pool`` says whether an instance id is one of the pool's (others' decisions about any other
        instance are ignored); ``on_message`` is called after each message heard, and ``on_delay`` (if
        given) with the seconds each batch took from its sender's clock to this one's (never below 0).
        ``predict`` is given each of the others' decisions too (the worker and the prompt's blocks): the
        router records them where it predicts that worker's cache (where KV events tell it, the workers
        do). Not ``enabled``, ``start`` does nothing and what the router says is dropped: the router's
        calls need no condition."""
        self.enabled = enabled
        self.replica_id = secrets.token_hex(8)
        # Each replica publishes on a subject of its own (NATS permissions can then bind a replica to it),
        # so its own messages are told apart without decoding them.
        self.subjects = sync_subjects(address)
        self.subject = self.subjects.removesuffix("*") + self.replica_id
        self._nc = nc
        self._block_size = block_size
        self._load = load
        self._predict = predict
        self._in_pool = in_pool
        self._on_message = on_message
        self._on_delay = on_delay
        self._clock = clock
        #: How long ends wait for a decision to ride with (ENDS_WAIT_S; bench/routing_sim.py varies it).
        self.ends_wait_s = ENDS_WAIT_S
        self._own: set[str] = set()  # this router's requests in flight
        self._pending: list[SyncEvent] = []
        self._routed_since = 0.0  # when the first decision among them was made, by the wall clock (0: none)
        self._ends_due: float | None = None  # when the ends among them must go at the latest (by clock)
        self._wake = asyncio.Event()
        self._peers: dict[str, _Peer] = {}
        self._next_reconcile = clock() + RECONCILE_S
        self._supervisor = Supervisor(on_fatal=lambda: None)  # both tasks are restarted: none is fatal
        self._subscribed = asyncio.Event()
        self._malformed = RateLimitedLog(log, period_s=MALFORMED_REPORT_S)
        self._publish_failed = RateLimitedLog(log, period_s=MALFORMED_REPORT_S)
        self._started = False
        self._over_nats = False  # started by start(), not begin()
        # Counters for tests and metrics.
        self.expired_replicas = 0

    @property
    def malformed(self) -> int:
        """Messages ignored as malformed (undecodable, out of bounds, another block size)."""
        return self._malformed.count

    def remote_requests(self) -> int:
        """Other replicas' requests applied to the load and not ended yet."""
        return sum(len(peer.requests) for peer in self._peers.values())

    def replicas(self) -> int:
        """Other replicas heard from and not forgotten."""
        return len(self._peers)

    def heard_at(self) -> dict[str, float]:
        """When each other replica was last heard from (by this router's clock)."""
        return {replica: peer.heard_at for replica, peer in self._peers.items()}

    async def start(self) -> None:
        """Listen to the other replicas (confirmed with NATS before returning) and start sending."""
        if not self.enabled or self._started:
            return
        self.begin()
        self._over_nats = True
        self._supervisor.own(self._listen, name=f"router replica sync on {self.subjects}", restart=True)
        self._supervisor.own(self._send_loop, name=f"router replica sync sender on {self.subject}", restart=True)
        try:
            async with asyncio.timeout(CONFIRM_TIMEOUT_S):
                await self._subscribed.wait()
            await flush(self._nc, within=CONFIRM_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error) as exc:
            # NATS is away: the subscription is made once it is back (nats-py sends it on reconnecting).
            log.warning("the router replica sync could not confirm its subscription to %s yet: %r", self.subjects, exc)

    def begin(self) -> None:
        """Start recording what this router decides, with no NATS: the caller carries the messages, taking
        them with ``take_batches`` and handing the others' to ``on_batch`` (``start`` does this over NATS;
        bench/routing_sim.py does it in simulated time)."""
        if self.enabled:
            self._started = True

    async def close(self) -> None:
        """Stop, telling the other replicas to forget this one's requests (best effort)."""
        await self._supervisor.close()
        if not self._started:
            return
        self._started = False
        if not self._over_nats:
            return  # begun without NATS: the caller carries the messages
        with contextlib.suppress(TimeoutError, nats.errors.Error):
            async with asyncio.timeout(GOODBYE_TIMEOUT_S):
                await self._publish(closing=True)
                await flush(self._nc, within=GOODBYE_TIMEOUT_S)

    # -- what this router says ----------------------------------------------------------------

    def routed(
        self, request_id: str, worker: Worker, *, prefill_tokens: int, hashes: Sequence[int], own_blocks: int
    ) -> None:
        """This router sent ``request_id`` to ``worker`` (the arguments of ActiveLoad.started): said at once."""
        if not self._started or len(request_id) > MAX_REQUEST_ID_CHARS or len(hashes) > MAX_HASHES:
            return  # the others would refuse it: say nothing rather than something malformed
        self._own.add(request_id)
        if self._peers:
            if not self._routed_since:
                self._routed_since = time.time()
            self._pending.append(Routed(request_id, worker[0], worker[1], prefill_tokens, own_blocks, list(hashes)))
            self._wake.set()

    def prefill_done(self, request_id: str) -> None:
        if self._peers and request_id in self._own:
            self._say_end(PrefillDone(request_id))

    def finished(self, request_id: str) -> None:
        if request_id in self._own:
            self._own.discard(request_id)
            if self._peers:
                self._say_end(Finished(request_id))

    def _say_end(self, event: PrefillDone | Finished) -> None:
        self._pending.append(event)
        if self._ends_due is None:
            self._ends_due = self._clock() + self.ends_wait_s
            self._wake.set()  # the sender waits for the heartbeat: it waits for this instead now

    def ends_due(self) -> float | None:
        """When what is waiting to be sent must go at the latest (by the router's clock): None when nothing
        waits, or when a decision does (it goes as soon as the sender runs)."""
        return None if self._routed_since else self._ends_due

    async def _send_loop(self) -> None:
        """Send a heartbeat at once (the others learn of this replica), then what was said since the last
        batch: a decision as soon as the loop lets this task run, ends when ENDS_WAIT_S passed since the
        first of them, a heartbeat when nothing was said for HEARTBEAT_S; forget the replicas that went
        silent."""
        while True:
            try:
                await self._publish()
            except nats.errors.Error as exc:
                # Best effort: what is lost here is corrected by the next list of requests in flight.
                self._publish_failed.warning(f"the router replica sync could not publish on {self.subject}: {exc!r}")
            self.expire_silent()
            await self._until_due(self._clock() + HEARTBEAT_S)

    async def _until_due(self, heartbeat_at: float) -> None:
        """Return when a batch is due: a decision was said, the ends waiting are due, or ``heartbeat_at``."""
        while not self._routed_since:
            due = heartbeat_at if self._ends_due is None else min(heartbeat_at, self._ends_due)
            remaining = due - self._clock()
            if remaining <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._wake.wait()

    async def _publish(self, *, closing: bool = False) -> None:
        for data in self.take_batches(closing=closing):
            await self._nc.publish(self.subject, data)

    def take_batches(self, *, closing: bool = False) -> list[bytes]:
        """The messages that say what was decided since the last call (at least one, a heartbeat when
        nothing was), in order, encoded for ``subject``; every RECONCILE_S the last lists the requests
        in flight."""
        events, self._pending = self._pending, []
        said_at = self._routed_since or time.time()
        self._routed_since, self._ends_due = 0.0, None
        active: list[str] | None = None
        if closing or self._clock() >= self._next_reconcile:
            self._next_reconcile = self._clock() + RECONCILE_S
            if not closing and self._peers and len(self._own) <= MAX_LISTED:
                active = list(self._own)
        chunks = list(_chunks(events)) or [[]]
        last = len(chunks) - 1
        # The list of requests in flight, and the goodbye, go with the last chunk: after every event.
        return [
            _encode(
                SyncBatch(
                    block_size=self._block_size,
                    events=chunk,
                    active=active if index == last else None,
                    closing=closing and index == last,
                    sent_at=said_at,
                )
            )
            for index, chunk in enumerate(chunks)
        ]

    # -- what the others say ------------------------------------------------------------------

    async def _listen(self) -> None:
        own = self.subject

        def deliver(message: Msg) -> None:
            if message.subject != own:
                self.on_batch(message.data, message.subject)
                self._on_message()

        await consume(self._nc, self.subjects, deliver, subscribed=self._subscribed)

    def on_batch(self, data: bytes, subject: str) -> None:
        """Apply the batch a replica sent on ``subject`` (this router's own are ignored; a malformed one
        is counted)."""
        replica = _replica_of(subject)
        if replica is None:
            self._malformed.warning(f"the router replica sync ignored a message on {subject}: not a replica's subject")
            return
        if replica == self.replica_id:
            return
        try:
            batch = _decode_batch(data)
        except msgspec.DecodeError as exc:  # ValidationError (a bound passed) is a DecodeError
            self._malformed.warning(f"the router replica sync ignored a malformed message on {subject}: {exc}")
            return
        if self._on_delay is not None and batch.sent_at > 0:
            # Wall clocks: across machines this includes their skew (NTP keeps it to about a millisecond).
            self._on_delay(max(0.0, time.time() - batch.sent_at))
        if batch.block_size != self._block_size:
            self._malformed.warning(
                f"the router replica sync ignored replica {replica}: its block size is {batch.block_size}, "
                f"not {self._block_size} (are its routers built from another model card?)"
            )
            return
        peer = self._peers.get(replica)
        if peer is None:
            if batch.closing:
                return
            if len(self._peers) >= MAX_REPLICAS:
                self._malformed.warning(f"the router replica sync ignored replica {replica}: {MAX_REPLICAS} known")
                return
            peer = self._peers[replica] = _Peer(heard_at=self._clock())
            log.debug("router replica %s of %s joined", replica, self.subjects)
        peer.heard_at = self._clock()
        prefix = f"{replica}\x00"  # its requests' keys: no other replica's, and no request id of this router's
        for event in batch.events:
            key = prefix + event.request_id
            if isinstance(event, Routed):
                self._apply_routed(replica, peer, key, event)
            elif key in peer.requests:
                if isinstance(event, PrefillDone):
                    self._load.prefill_done(key)
                else:
                    peer.requests.discard(key)
                    self._load.finished(key)
        if batch.active is not None:
            listed = {prefix + request_id for request_id in batch.active}
            for key in peer.requests - listed:  # their end was lost
                peer.requests.discard(key)
                self._load.finished(key)
        if batch.closing:
            self._forget(replica)

    def _apply_routed(self, replica: str, peer: _Peer, key: str, event: Routed) -> None:
        if not self._in_pool(event.instance_id):
            return  # not in this pool (yet, or any more)
        if key not in peer.requests and len(peer.requests) >= MAX_REQUESTS_PER_REPLICA:
            self._malformed.warning(
                f"the router replica sync ignored a request of replica {replica}: it has "
                f"{MAX_REQUESTS_PER_REPLICA} in flight already"
            )
            return
        worker = (event.instance_id, event.dp_rank)
        peer.requests.add(key)
        self._load.started(
            key, worker, prefill_tokens=event.prefill_tokens, hashes=event.hashes, own_blocks=event.own_blocks
        )
        if event.hashes:
            self._predict(worker, event.hashes)

    def expire_silent(self) -> None:
        """Forget the replicas not heard from for EXPIRE_AFTER_S, and their requests."""
        now = self._clock()
        for replica in [replica for replica, peer in self._peers.items() if now - peer.heard_at > EXPIRE_AFTER_S]:
            log.info(
                "router replica %s of %s was silent for %.0f s: its %d requests no longer count",
                replica, self.subjects, now - self._peers[replica].heard_at, len(self._peers[replica].requests),
            )  # fmt: skip
            self._forget(replica)
            self.expired_replicas += 1

    def _forget(self, replica: str) -> None:
        peer = self._peers.pop(replica, None)
        if peer is None:
            return
        for key in peer.requests:
            self._load.finished(key)


def _chunks(events: list[SyncEvent]) -> Iterator[list[SyncEvent]]:
    """``events`` in order, cut into batches of at most MAX_EVENTS_PER_BATCH and about HASHES_PER_BATCH hashes."""
    chunk: list[SyncEvent] = []
    hashes = 0
    for event in events:
        size = len(event.hashes) if isinstance(event, Routed) else 0
        if chunk and (len(chunk) >= MAX_EVENTS_PER_BATCH or hashes + size > HASHES_PER_BATCH):
            yield chunk
            chunk, hashes = [], 0
        chunk.append(event)
        hashes += size
    if chunk:
        yield chunk
