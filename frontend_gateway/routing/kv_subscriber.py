"""A KV router's side of KV events: hearing the workers' events and load reports, and keeping them whole.

The worker's side is runtime/kv/publisher.py. A ``KvEventSubscriber`` listens, on the subjects of every
component its pool's instances serve, to the workers' KV event batches (which blocks each holds) and load
reports, and hands what it hears to a ``KvEventTarget`` (the router's index of cached blocks and its
load). It is the part of the router that deals with the network being what it is:

* **Gaps.** Batches are numbered 1, 2, 3 ... per (instance, dp rank). A batch whose ``event_id`` is not
  one more than the last seen means batches were lost (or this router came late): what they said is
  unknown, so the worker is asked for its whole cache (``KvStateRequest`` on its ``kv_state`` subject).
* **Stale batches.** A batch at or below the last id seen (a duplicate, or one overtaken by a
  whole-state answer) is dropped.
* **State syncs.** Each instance that joins is asked for its whole cache, and so is each dp rank that
  shows up and each worker whose batches show a gap; an unanswered ask is made again a few times (a
  worker may register in etcd a moment before it answers on NATS). An answer (``event_id`` 0) replaces
  what the target knew of that worker. It names the last batch it covers (``covers_event_id``): the
  batches heard while it was on its way (on another subject, so possibly before it) are held, and those
  it does not cover are applied on top of it, so that neither a block stored nor one removed meanwhile
  is lost. An answer larger than a NATS message comes in parts, put together before it is applied.
* **Whose blocks.** A pool's index takes the blocks of the pool's model only (``routable``): a LoRA adapter's
  pool those its workers computed with that adapter (``BlockStored.lora_id``), the base model's pool those
  computed without one; salted blocks are set aside. Blocks on a tier below the device (host memory, a disk)
  are indexed on that tier.
* **Malformed messages** are dropped and reported, at most one log line per ``MALFORMED_REPORT_S``.

One subscriber listens per component rather than pool only like endpoints: a pool is the instances that
answer alike (frontend_gateway/models/watcher.py card_differences), and where an instance listens says
how to reach it, not how it answers. Instances of one served model under two namespaces or components
(a pipeline redeployed under a new name, two deployments of one model) then all serve, with their caches
known. The cost is one pair of subscriptions per component, made when its first instance joins, dropped
when its last leaves (the first instance's component is listened to from ``start`` to ``close``); an
instance is asked for its cache only once its component's subscriptions are confirmed, so that no event
between the answer and the subscription is lost.

Events of instances that are not (or no longer) in the pool are ignored, so an instance that left cannot
come back through a late event. With ``use_kv_events`` off, only load reports are heard. Every listening
and asking task is supervised: one that fails is logged and started again. What was repaired or refused
is counted (``gaps``, ``stale_batches``, ``state_syncs``, ``malformed``) and told to a
``KvSubscriberHealth`` when one is given (the gateway's Prometheus counters).
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.nats_connection import consume, flush
from runtime.kv.events import BlockStored, KvEvent, KvEventBatch, KvStateRequest, WorkerLoad
from runtime.rate_limited_log import RateLimitedLog
from runtime.supervision import Supervisor

log = logging.getLogger(__name__)

_decode_batch = msgspec.msgpack.Decoder(KvEventBatch).decode
_decode_load = msgspec.json.Decoder(WorkerLoad).decode
_encode = msgspec.msgpack.Encoder().encode

#: How long one ask for a worker's cache state waits, and the pauses between the asks that go unanswered
#: (a worker may register in etcd a moment before it answers on NATS).
STATE_TIMEOUT_S = 2.0
STATE_RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0)
#: Malformed messages are reported at most this often (with how many there were).
MALFORMED_REPORT_S = 10.0
#: dp ranks above this are taken for garbage rather than a worker with that many ranks.
MAX_DP_RANK = 1023
#: A worker whose state was just received (from a publisher that does not say which batch it covers)
#: accepts any next event_id as its new baseline.
_BASELINE = -1
#: Batches held for a worker whose state is on its way (more are dropped, and the state asked again), and
#: the parts a state answer may come in (a million blocks a part: far more than any cache).
MAX_HELD_BATCHES = 1024
MAX_STATE_PARTS = 1024


def routable(events: list[KvEvent], lora_id: int | None = None) -> list[KvEvent]:
    """The events the index of a pool of adapter ``lora_id`` (None: the base model) takes: blocks computed
    with that adapter (None: with none), unsalted (on any tier: the index keeps each tier apart, and a removal
    from one leaves the others' blocks alone).

    Each pool is one model, base or adapter (runtime/lora.py): another's blocks could never match one of its
    requests, and a router names a request's blocks from its tokens alone, so a block computed with a cache
    salt could not either. Such events are heard (workers publish all their blocks on one subject) and set aside.
    """
    if all(_ours(event, lora_id) for event in events):
        return events
    return [event for event in events if _ours(event, lora_id)]


def _ours(event: KvEvent, lora_id: int | None) -> bool:
    if isinstance(event, BlockStored):
        return event.lora_id == lora_id and event.salt is None
    return True


#: A worker as routers see it: (instance id, dp rank).
Worker = tuple[int, int]


class KvEventTarget(Protocol):
    """What the subscriber feeds: a router's index of cached blocks, and its view of the workers' load."""

    def apply_events(self, worker: Worker, events: list[KvEvent]) -> None:
        """``worker``'s events since the last ones applied, in order."""
        ...

    def replace_state(self, worker: Worker, events: list[KvEvent]) -> None:
        """``worker``'s whole cache, replacing whatever was known of it."""
        ...

    def observe_load(self, report: WorkerLoad) -> None:
        """A load report of an instance in the pool."""
        ...


class KvSubscriberHealth(Protocol):
    """Told of each repair and refusal as it happens (the gateway counts them for Prometheus)."""

    def gap(self) -> None: ...

    def stale_batch(self) -> None: ...

    def state_sync(self) -> None: ...

    def malformed(self) -> None: ...


class KvEventSubscriber:
    """Listens to the KV events and load reports of one pool's instances, for one router."""

    def __init__(
        self,
        nc: NATS,
        address: EndpointAddress,
        target: KvEventTarget,
        *,
        use_kv_events: bool = True,
        health: KvSubscriberHealth | None = None,
        lora_id: int | None = None,
    ) -> None:
        """``lora_id``: the pool's LoRA adapter (None: the base model), whose blocks alone are indexed."""
        self.address = address
        self.lora_id = lora_id
        self.use_kv_events = use_kv_events
        self._nc = nc
        self._target = target
        self._health = health
        self._instances: set[int] = set()  # in the pool: only their events and reports count
        self._silent: set[int] = set()  # in the pool, and their engines publish no KV events: never asked
        self._ranks: dict[int, tuple[int, ...]] = {}  # instance -> dp ranks seen (0 until others show up)
        self._last_event: dict[Worker, int] = {}
        self._component_of: dict[int, tuple[str, str]] = {}  # instance -> its (namespace, component)
        self._components: dict[tuple[str, str], _Component] = {}
        self._syncing: set[Worker] = set()
        # Batches heard while their worker's state is asked for, applied after the answer; workers to ask again.
        self._held: dict[Worker, list[KvEventBatch]] = {}
        self._resync: set[Worker] = set()
        # The asks for workers' caches: one that fails (a bug, not an unanswered ask) is logged and made again.
        self._syncs = Supervisor(on_fatal=lambda: None)
        self._supervisor = Supervisor(on_fatal=lambda: None)  # every task is restarted: none is fatal
        self._malformed = RateLimitedLog(log, period_s=MALFORMED_REPORT_S)
        self._closed = False
        self.changed = asyncio.Event()  # set after every message heard (tests await it)
        #: What was repaired: batches that showed a gap, stale batches dropped, whole-state answers applied.
        self.gaps = 0
        self.stale_batches = 0
        self.state_syncs = 0

    @property
    def ranks(self) -> Mapping[int, tuple[int, ...]]:
        """The dp ranks seen of each instance in the pool (read-only: the router routes to them)."""
        return self._ranks

    @property
    def malformed(self) -> int:
        """Malformed messages dropped (events, load reports, state answers)."""
        return self._malformed.count

    @property
    def asking(self) -> int:
        """Asks for workers' caches under way."""
        return self._syncs.running

    def component_names(self) -> list[str]:
        """The components listened to, as ``namespace.component``."""
        return [component.name for component in self._components.values()]

    async def start(self) -> None:
        """Subscribe to the load reports (and KV events) of the pool's first component and wait until NATS
        has the subscriptions; that component is listened to until ``close``."""
        component = self._listen(self.address, home=True)
        await component.confirmed(self._nc)

    async def close(self) -> None:
        """Stop listening and asking; the subscriber is not used afterwards."""
        self._closed = True
        components, self._components = list(self._components.values()), {}
        supervisors = [self._syncs, *(component.supervisor for component in components), self._supervisor]
        for supervisor in supervisors:
            supervisor.cancel()  # all of them before the first wait, so that none of their tasks runs again
        for supervisor in supervisors:
            await supervisor.close()

    def instance_added(self, instance_id: int, address: EndpointAddress | None, *, kv_events: bool = True) -> None:
        """Count ``instance_id`` (serving ``address``; None: the pool's first) in, and ask it for its cache
        unless its registration says its engine publishes no KV events (its load reports are still heard)."""
        if instance_id in self._instances:
            return
        if not kv_events:
            self._silent.add(instance_id)
        address = address or self.address
        key = (address.namespace, address.component)
        component = self._components.get(key) or self._listen(address, home=False)
        component.instances.add(instance_id)
        self._component_of[instance_id] = key
        self._instances.add(instance_id)
        self._ranks.setdefault(instance_id, (0,))
        if self.use_kv_events and kv_events:
            self._ask_state((instance_id, 0))

    def instance_removed(self, instance_id: int) -> None:
        """Forget ``instance_id``: its ranks and event ids; its late events and reports will be ignored."""
        self._instances.discard(instance_id)
        self._silent.discard(instance_id)
        self._ranks.pop(instance_id, None)
        key = self._component_of.pop(instance_id, None)
        component = self._components.get(key) if key is not None else None
        if component is not None:
            component.instances.discard(instance_id)
            if not component.home and not component.instances:
                # Its last instance left: stop listening to it (in a task, owned like the others).
                del self._components[component.key]
                self._supervisor.own(component.supervisor.close, name=f"closing {component.name}", restart=False)
        for worker in [worker for worker in self._last_event if worker[0] == instance_id]:
            del self._last_event[worker]
        for worker in [worker for worker in self._held if worker[0] == instance_id]:
            del self._held[worker]

    # -- what the subscriber hears ----------------------------------------------------------------

    def _on_events(self, data: bytes, subject: str | None = None) -> None:
        try:
            batch = _decode_batch(data)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            where = subject or self.address.kv_events_subject()
            self._report_malformed(f"a malformed KV event batch on {where}: {exc}")
            return
        if batch.event_id < 0 or not 0 <= batch.dp_rank <= MAX_DP_RANK:
            self._report_malformed(f"a KV event batch with event_id {batch.event_id}, dp_rank {batch.dp_rank}")
            return
        if batch.instance_id not in self._instances:
            return  # not in this pool (yet, or any more): joining asks for the whole state anyway
        worker = (batch.instance_id, batch.dp_rank)
        self._note_rank(worker)
        if batch.event_id == 0:
            return  # a state answer comes as a reply to the router that asked, never on the events subject
        if worker in self._syncing:
            # Its state is on its way: a batch heard first may be newer than the answer (another subject,
            # no order between them), so it is applied after the answer, on top, unless the answer covers it.
            held = self._held.setdefault(worker, [])
            if len(held) < MAX_HELD_BATCHES:
                held.append(batch)
            else:
                self._resync.add(worker)  # what it said is lost: ask again once this answer is in
            return
        self._take(worker, batch)

    def _take(self, worker: Worker, batch: KvEventBatch) -> None:
        """Apply ``batch`` of ``worker`` unless it is stale; a gap before it asks for the whole state."""
        last = self._last_event.get(worker)
        if last is not None and last != _BASELINE and batch.event_id <= last:
            self.stale_batches += 1  # a duplicate, or one overtaken by a whole-state answer
            if self._health is not None:
                self._health.stale_batch()
            return
        self._target.apply_events(worker, routable(batch.events, self.lora_id))
        self._last_event[worker] = batch.event_id
        expected = 1 if last is None else last + 1
        if last != _BASELINE and batch.event_id != expected:
            # Batches were lost (or this router came late): what they said is unknown, so ask for all of it.
            self.gaps += 1
            if self._health is not None:
                self._health.gap()
            log.debug("KV events of %x rank %d jumped to %d (expected %d)", *worker, batch.event_id, expected)
            self._ask_state(worker)

    def _on_load(self, data: bytes, subject: str | None = None) -> None:
        try:
            report = _decode_load(data)
        except msgspec.DecodeError as exc:
            self._report_malformed(
                f"a malformed load report on {subject or self.address.load_metrics_subject()}: {exc}"
            )
            return
        if report.instance_id not in self._instances or not 0 <= report.dp_rank <= MAX_DP_RANK:
            return
        self._note_rank((report.instance_id, report.dp_rank))
        self._target.observe_load(report)

    def _note_rank(self, worker: Worker) -> None:
        """Route to dp ranks as they show up; a new rank is asked for its cache too."""
        instance_id, rank = worker
        ranks = self._ranks.get(instance_id, (0,))
        if rank in ranks:
            return
        self._ranks[instance_id] = tuple(sorted((*ranks, rank)))
        if self.use_kv_events and instance_id not in self._silent:
            self._ask_state(worker)

    def _apply_state(self, worker: Worker, batch: KvEventBatch) -> None:
        """Replace what is known of ``worker`` with its state answer, then apply the batches held meanwhile
        that the answer does not cover."""
        self._target.replace_state(worker, routable(batch.events, self.lora_id))
        self.state_syncs += 1
        if self._health is not None:
            self._health.state_sync()
        held = sorted(self._held.pop(worker, []), key=lambda batch: batch.event_id)
        if batch.covers_event_id is None:
            # A publisher that does not say what its answer covers: the next batch, whatever its id, continues
            # from it, and those heard meanwhile are taken as covered.
            self._last_event[worker] = _BASELINE
            return
        self._last_event[worker] = batch.covers_event_id
        for later in held:
            self._take(worker, later)

    def _report_malformed(self, what: str) -> None:
        self._malformed.warning(f"the KV router ignored {what}")
        if self._health is not None:
            self._health.malformed()

    # -- asking a worker for its cache -----------------------------------------------------------

    def _ask_state(self, worker: Worker) -> None:
        if self._closed:
            return
        if worker in self._syncing:
            self._resync.add(worker)  # asked again while an ask is under way: once it is done
            return
        self._syncing.add(worker)
        self._syncs.own(
            lambda: self._sync_state(worker), name=f"KV state of {worker[0]:x} rank {worker[1]}", restart=True
        )

    async def _sync_state(self, worker: Worker) -> None:
        """Ask ``worker`` for its cache until answered or given up (see _ask_for_state); on a failure the
        worker stays being synced, and the supervisor logs it and starts the asking over."""
        failed = False
        try:
            await self._ask_for_state(worker)
        except Exception:
            failed = True
            raise
        finally:
            if not failed:
                self._syncing.discard(worker)
                # Unanswered: the batches held meanwhile are applied as they would have been without the ask.
                for batch in sorted(self._held.pop(worker, []), key=lambda batch: batch.event_id):
                    self._take(worker, batch)
                if worker in self._resync:
                    self._resync.discard(worker)
                    self._ask_state(worker)
            self.changed.set()

    async def _ask_for_state(self, worker: Worker) -> None:
        """Ask ``worker`` for its whole cache, a few times if it does not answer; apply the answer."""
        instance_id, rank = worker
        component = self._components.get(self._component_of.get(instance_id, ("", "")))
        address = component.address if component is not None else self.address
        subject = address.kv_state_subject(instance_id)
        why = "no answer"
        if component is not None and not component.home:
            # An answer that came before the events were heard would miss those in between.
            await component.confirmed(self._nc)
        for delay in (*STATE_RETRY_DELAYS_S, None):
            if instance_id not in self._instances:
                return
            try:
                answer = await self._request_state(worker, subject)
            except (nats.errors.Error, TimeoutError) as exc:
                why = type(exc).__name__
            else:
                if answer is not None and instance_id in self._instances:
                    self._apply_state(worker, answer)
                return
            if delay is not None:
                await asyncio.sleep(delay)
        log.info(
            "instance %x rank %d did not send its KV cache state (%s): its cache is learned from its events only",
            instance_id, rank, why,
        )  # fmt: skip

    async def _request_state(self, worker: Worker, subject: str) -> KvEventBatch | None:
        """``worker``'s whole state, its parts put together; None for a malformed answer (reported).

        The first part is the request's reply (so that a worker not listening is known at once); the others
        come to an inbox of this ask. Raises nats.errors.Error or TimeoutError when an answer is not whole
        within STATE_TIMEOUT_S of its previous part.
        """
        inbox = self._nc.new_inbox()
        parts_inbox = await self._nc.subscribe(inbox)
        try:
            payload = _encode(KvStateRequest(dp_rank=worker[1], parts_to=inbox))
            reply = await self._nc.request(subject, payload, timeout=STATE_TIMEOUT_S)
            first = self._state_part(worker, reply.data, None)
            if first is None:
                return None
            parts = {first.part: first}
            while len(parts) < first.parts:
                message = await parts_inbox.next_msg(timeout=STATE_TIMEOUT_S)
                part = self._state_part(worker, message.data, first)
                if part is None:
                    return None
                parts[part.part] = part
        finally:
            with contextlib.suppress(Exception):
                await parts_inbox.unsubscribe()
        events = [event for index in range(first.parts) for event in parts[index].events]
        return msgspec.structs.replace(first, events=events, part=0, parts=1)

    def _state_part(self, worker: Worker, data: bytes, first: KvEventBatch | None) -> KvEventBatch | None:
        """One part of ``worker``'s state answer, checked against the first part; None (reported) if it is
        malformed or belongs to another answer."""
        try:
            batch = _decode_batch(data)
        except msgspec.DecodeError as exc:
            self._report_malformed(f"a malformed KV state answer from {worker[0]:x}: {exc}")
            return None
        if (batch.instance_id, batch.dp_rank) != worker or batch.event_id != 0:
            self._report_malformed(f"a KV state answer for {batch.instance_id:x} rank {batch.dp_rank}, not {worker}")
            return None
        if not 0 <= batch.part < batch.parts <= MAX_STATE_PARTS or (
            first is not None and (batch.parts, batch.covers_event_id) != (first.parts, first.covers_event_id)
        ):
            self._report_malformed(f"a KV state answer from {worker[0]:x} with part {batch.part} of {batch.parts}")
            return None
        return batch

    # -- listening ---------------------------------------------------------------------------------

    def _listen(self, address: EndpointAddress, *, home: bool) -> "_Component":
        """Start listening to the load reports (and KV events) of ``address``'s component."""
        component = _Component(address, home=home)
        self._components[component.key] = component
        if not home:
            log.info(
                "the KV router of %s listens to %s too (an instance of its pool serves there)", self.address, address
            )
        self._own_listener(component, address.load_metrics_subject(), self._on_load, "load reports")
        if self.use_kv_events:
            self._own_listener(component, address.kv_events_subject(), self._on_events, "KV events")
        return component

    def _own_listener(
        self, component: "_Component", subject: str, handle: Callable[[bytes, str], None], what: str
    ) -> None:
        """Listen on ``subject`` in a task of ``component``'s supervisor (re-subscribing after a failure)."""
        subscribed = asyncio.Event()
        component.subscribed.append(subscribed)

        def deliver(message: Msg) -> None:
            handle(message.data, subject)
            self.changed.set()

        async def listen() -> None:
            await consume(self._nc, subject, deliver, subscribed=subscribed)

        component.supervisor.own(listen, name=f"KV router {what} on {subject}", restart=True)


class _Component:
    """One component a pool's instances serve: its listeners, and the pool's instances there."""

    def __init__(self, address: EndpointAddress, *, home: bool) -> None:
        self.address = address
        self.key = (address.namespace, address.component)
        self.name = f"{address.namespace}.{address.component}"
        #: The first instance's component: listened to from ``start`` to ``close``, whoever is in it.
        self.home = home
        self.instances: set[int] = set()
        self.subscribed: list[asyncio.Event] = []
        self.supervisor = Supervisor(on_fatal=lambda: None)  # every listener is restarted: none is fatal

    async def confirmed(self, nc: NATS) -> None:
        """Wait until NATS has this component's subscriptions (a warning, not an error, if it cannot say)."""
        try:
            async with asyncio.timeout(STATE_TIMEOUT_S):
                for ready in self.subscribed:
                    await ready.wait()
            await flush(nc, within=STATE_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error) as exc:
            # NATS is away: the subscriptions are made (nats-py sends them once it reconnects) or retried.
            log.warning("the KV router could not confirm its subscriptions to %s yet: %r", self.name, exc)
