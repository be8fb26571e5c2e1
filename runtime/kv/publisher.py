"""A worker's side of KV-aware routing: its engine's KV events and cache state, on NATS.

When a worker's engine is a ``KvEventSource`` (runtime/kv/events.py), the worker gives it a
``KvEventPublisher`` as its sink before serving. The publisher gathers the engine's events per dp
rank and publishes them every ``KV_EVENTS_INTERVAL`` seconds as one ``KvEventBatch`` per rank
(msgpack, on the component's ``kv_events`` subject), numbered 1, 2, 3 ... per rank. A batch that
NATS does not take (a reconnect, a full buffer) is lost but still numbered, so routers see the gap
and ask for the whole state; publishing goes on. The publisher also answers ``KvStateRequest`` on
the instance's ``kv_state`` subject with a batch (``event_id`` 0) that describes every cached block
of the rank asked for (one batch per rank when none is named) and names the last batch it covers
(``covers_event_id``). An answer larger than a NATS message goes in parts: the first as the reply, the
others to the subject the request names (``parts_to``).
"""

import asyncio
import logging
from typing import TYPE_CHECKING

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from runtime.cluster.addressing import EndpointAddress
from runtime.kv.events import BlockStored, KvEvent, KvEventBatch, KvEventSource, KvStateRequest
from runtime.rate_limited_log import RateLimitedLog

if TYPE_CHECKING:
    from runtime.distributed import DistributedRuntime

log = logging.getLogger(__name__)

#: How long events gather before they leave as one batch per rank (seconds).
KV_EVENTS_INTERVAL = 0.005
#: Lost batches are logged at most this often (the rest at debug level).
LOSS_REPORT_S = 10.0
#: Sizing a state answer's parts: msgpack takes at most 9 bytes a block hash (10 with room for the events'
#: own bytes), the rest of a batch fits in the overhead; NATS's default max_payload when the server says none.
BYTES_PER_HASH = 10
PART_OVERHEAD_BYTES = 4096
DEFAULT_MAX_PAYLOAD = 1024 * 1024

_encode = msgspec.msgpack.Encoder().encode
_decode_state_request = msgspec.msgpack.Decoder(KvStateRequest).decode


class KvEventPublisher:
    """The ``KvEventSink`` of one worker instance: batches per dp rank, published every few ms."""

    def __init__(
        self,
        nc: NATS,
        address: EndpointAddress,
        instance_id: int,
        source: KvEventSource,
        *,
        interval: float = KV_EVENTS_INTERVAL,
        max_part_hashes: int | None = None,
    ) -> None:
        self._nc = nc
        #: The endpoint it publishes for, and its NATS connection: an engine whose ranks run on other nodes hears
        #: their events over it (engines/sglang/dp_relay.py).
        self.address = address
        self._instance_id = instance_id
        self._source = source
        self.interval = interval
        #: Block hashes per part of a state answer (None: as many as a NATS message takes).
        self.max_part_hashes = max_part_hashes
        self.events_subject = address.kv_events_subject()
        self.state_subject = address.kv_state_subject(instance_id)
        self._pending: dict[int, list[KvEvent]] = {}
        self._next_event_id: dict[int, int] = {}
        self._ready = asyncio.Event()
        # One flush at a time: batches of a rank must leave in the order of their ids.
        self._flushing = asyncio.Lock()
        self._subscription: Subscription | None = None
        self._losses = RateLimitedLog(log, period_s=LOSS_REPORT_S, held_level=logging.DEBUG)
        #: Counters for tests and metrics.
        self.batches_published = 0
        self.batches_lost = 0
        self.state_answers = 0

    @property
    def nc(self) -> NATS:
        return self._nc

    # -- KvEventSink -------------------------------------------------------------------------------

    def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
        """Queue ``events`` of ``dp_rank`` for the next batch (never blocks)."""
        pending = self._pending.get(dp_rank)
        if pending is None:
            self._pending[dp_rank] = list(events)
        else:
            pending.extend(events)
        self._ready.set()

    # -- the worker's tasks ------------------------------------------------------------------------

    async def start(self) -> None:
        """Answer cache state asks from now on (nats-py subscribes again by itself after a reconnect)."""
        self._subscription = await self._nc.subscribe(self.state_subject, cb=self._answer_state)

    async def publish_forever(self) -> None:
        """Publish what gathered every ``interval`` seconds while events come, until cancelled."""
        while True:
            await self._ready.wait()
            await asyncio.sleep(self.interval)  # let the next few steps' events join the batch
            await self.flush()

    async def flush(self) -> None:
        """Publish the events gathered so far, one batch per rank."""
        async with self._flushing:
            self._ready.clear()
            pending, self._pending = self._pending, {}
            for dp_rank, events in pending.items():
                event_id = self._next_event_id.get(dp_rank, 1)
                self._next_event_id[dp_rank] = event_id + 1
                batch = KvEventBatch(instance_id=self._instance_id, dp_rank=dp_rank, event_id=event_id, events=events)
                try:
                    await self._nc.publish(self.events_subject, _encode(batch))
                except nats.errors.Error as exc:
                    self.batches_lost += 1
                    self._report_loss(dp_rank, event_id, exc)
                else:
                    self.batches_published += 1

    async def _answer_state(self, msg: Msg) -> None:
        try:
            ask = _decode_state_request(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("a malformed KV state request on %s: %s", self.state_subject, exc)
            return
        if not msg.reply:
            return
        # Events from before the answer go first, so that a router applies them before the state; the answer
        # says which batch it covers up to, so that a router applies the batches after it on top.
        await self.flush()
        state = self._source.cache_state(ask.dp_rank)
        ranks = sorted(state) if ask.dp_rank is None else [ask.dp_rank]
        answers = [
            (dp_rank, self._next_event_id.get(dp_rank, 1) - 1, events)
            for dp_rank in ranks
            for events in state_parts(state.get(dp_rank, []), self._part_hashes())
        ]
        if ask.parts_to is None and len(answers) > 1:
            log.warning(
                "a KV state request on %s cannot take the %d parts of its answer (an older router): it gets the first",
                self.state_subject, len(answers),
            )  # fmt: skip
            answers = answers[:1]
        for part, (dp_rank, covers, events) in enumerate(answers):
            batch = KvEventBatch(
                instance_id=self._instance_id, dp_rank=dp_rank, event_id=0, events=events,
                part=part, parts=len(answers), covers_event_id=covers,
            )  # fmt: skip
            try:
                if part == 0:
                    await msg.respond(_encode(batch))
                elif ask.parts_to is not None:
                    await self._nc.publish(ask.parts_to, _encode(batch))
            except nats.errors.Error as exc:
                log.info("could not answer a KV state request on %s: %r", self.state_subject, exc)
                return
        self.state_answers += 1

    def _part_hashes(self) -> int:
        """How many block hashes one part of a state answer may carry: a NATS message's worth, with room."""
        if self.max_part_hashes is not None:
            return self.max_part_hashes
        max_payload = self._nc.max_payload or DEFAULT_MAX_PAYLOAD
        return max(1, (max_payload - PART_OVERHEAD_BYTES) // BYTES_PER_HASH)

    def _report_loss(self, dp_rank: int, event_id: int, exc: Exception) -> None:
        self._losses.warning(
            f"KV event batch {event_id} of rank {dp_rank} was not published ({exc!r}); routers will ask for the "
            "whole cache"
        )


def state_parts(events: list[BlockStored], max_hashes: int) -> list[list[KvEvent]]:
    """``events`` (a rank's cache as stored events in prefix order) cut into parts of at most ``max_hashes``
    block hashes; an event cut in two continues in the next part with its parent named. At least one part."""
    parts: list[list[KvEvent]] = [[]]
    room = max_hashes
    for event in events:
        hashes, parent = event.block_hashes, event.parent_hash
        while hashes:
            if room == 0:
                parts.append([])
                room = max_hashes
            piece, hashes = hashes[:room], hashes[room:]
            parts[-1].append(msgspec.structs.replace(event, block_hashes=piece, parent_hash=parent, token_ids=None))
            parent = piece[-1]
            room -= len(piece)
    return parts


async def start_kv_publishing(
    runtime: "DistributedRuntime", address: EndpointAddress, source: KvEventSource
) -> KvEventPublisher:
    """Attach a publisher to ``source``, answer state asks, and own its publishing task (restarted if it fails)."""
    publisher = KvEventPublisher(runtime.nc, address, runtime.instance_id, source)
    source.attach_kv_events(publisher)
    await publisher.start()
    runtime.own(publisher.publish_forever, name=f"KV events {address}", restart=True)
    return publisher
