"""The KV-aware router (``--router-mode kv``): each request to the worker where it costs least.

It listens, on the subjects of the components its pool's instances serve, to the workers' KV events
(which blocks each holds) and load reports, hashes each request's prompt in blocks of the card's
block size, and scores the candidates with kv_scoring.py. Its decision (``choose``) is pure; the
listening happens in tasks started by ``start`` (the first instance's component) and
``instance_added`` (any other component), supervised (a failed subscription is logged and made
again) and stopped by ``close``, or when the last instance of a component leaves.

One router listens per component rather than pool only like endpoints: a pool is the instances
that answer alike (model_watcher.card_differences), and where an instance listens says how to
reach it, not how it answers. Instances of one served model under two namespaces or components (a
pipeline redeployed under a new name, two deployments of one model) then all serve, with their
caches known; refusing the second set would leave it idle with nothing but a log line. The cost is
one pair of subscriptions per component, made when its first instance joins, dropped when its last
leaves; an instance is asked for its cache only once its component's subscriptions are confirmed, so
that no event between the answer and the subscription is lost.

The index starts from what the workers say: each instance that joins is asked for its whole cache
(``KvStateRequest`` on its ``kv_state`` subject), and asked again whenever its event batches show a
gap (``event_id`` not one more than the last seen), so that a restarted ingress, or one that missed
a batch, routes from the workers' real state rather than from nothing. Events of instances that are
not (or no longer) in the pool are ignored, so an instance that left cannot come back through a
late event. With ``use_kv_events`` off, no events are read: the index predicts the caches from the
router's own decisions (kv_indexer.PredictedKvIndexer).
"""

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Sequence

import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from frontend_gateway.routing.kv_indexer import KvIndexer, PredictedKvIndexer, Worker
from frontend_gateway.routing.kv_load import ActiveLoad
from frontend_gateway.routing.kv_scoring import WorkerSnapshot, choose_worker
from frontend_gateway.routing.protocol import Decision, InstanceInfo, RouterSettings
from runtime.addressing import EndpointAddress
from runtime.kv_blocks import sequence_block_hashes
from runtime.kv_events import KvEventBatch, KvStateRequest, WorkerLoad
from runtime.nats_connection import flush
from runtime.protocol import PreprocessedRequest, TextRequest
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
#: The longest answer a request is expected to write, for the blocks it will hold: ``max_tokens`` is an
#: upper bound, and a client that leaves it out gets the whole context left, which few answers fill.
EXPECTED_ANSWER_CAP_TOKENS = 512
#: A worker whose state was just received accepts any next event_id as its new baseline.
_BASELINE = -1


class KvRouter:
    """Routes each request of one model pool to the worker with the lowest KV cost."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        block_size: int,
        nc: NATS,
        address: EndpointAddress,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Raises ValueError for a block size below 1."""
        if block_size < 1:
            raise ValueError(f"the KV block size must be at least 1, not {block_size}")
        self.settings = settings
        self.block_size = block_size
        self.address = address
        self._nc = nc
        self._rng = random.Random(settings.seed)
        self.indexer: KvIndexer | PredictedKvIndexer
        if settings.use_kv_events:
            self.indexer = KvIndexer()
        else:
            self.indexer = PredictedKvIndexer(
                ttl_s=settings.predicted_ttl_s, max_blocks=settings.predicted_max_blocks, clock=clock
            )
        self.load = ActiveLoad(clock=clock)
        self._instances: set[int] = set()  # in the pool: only their events and reports count
        self._ranks: dict[int, tuple[int, ...]] = {}  # instance -> dp ranks seen (0 until others show up)
        self._last_event: dict[Worker, int] = {}
        self._component_of: dict[int, tuple[str, str]] = {}  # instance -> its (namespace, component)
        self._components: dict[tuple[str, str], _Component] = {}
        self._syncing: set[Worker] = set()
        # The asks for workers' caches: one that fails (a bug, not an unanswered ask) is logged and made again.
        self._syncs = Supervisor(on_fatal=lambda: None)
        self._supervisor = Supervisor(on_fatal=lambda: None)  # every task is restarted: none is fatal
        self._malformed = _RateLimitedWarning(MALFORMED_REPORT_S)
        self._closed = False
        self.changed = asyncio.Event()  # set after every message heard (tests await it)
        # Counters for tests and metrics.
        self.gaps = 0
        self.stale_batches = 0
        self.state_syncs = 0

    async def start(self) -> None:
        """Subscribe to the load reports (and KV events) of the pool's first component and wait until NATS
        has the subscriptions; that component is listened to until ``close``."""
        component = self._listen(self.address, home=True)
        await component.confirmed(self._nc)

    async def close(self) -> None:
        """Stop listening and asking; the router is not used afterwards."""
        self._closed = True
        await self._syncs.close()
        components, self._components = list(self._components.values()), {}
        for component in components:
            await component.supervisor.close()
        await self._supervisor.close()

    def choose(self, request: PreprocessedRequest | TextRequest, candidates: Sequence[InstanceInfo]) -> Decision | None:
        """The candidate (and dp rank) where ``request`` costs least; None when there is no candidate."""
        if not candidates:
            return None
        if isinstance(request, PreprocessedRequest):
            prompt_tokens = len(request.token_ids)
            hashes = sequence_block_hashes(request.token_ids, self.block_size)
            matches = self.indexer.find_matches(hashes)
            # Its last partial block and its answer's blocks are its own wherever it goes.
            answer = min(request.stop_conditions.max_tokens, EXPECTED_ANSWER_CAP_TOKENS)
            own_blocks = math.ceil((prompt_tokens % self.block_size + answer) / self.block_size)
        else:  # a text engine tokenizes for itself: no blocks to match; one block each, to spread by count
            prompt_tokens, hashes, matches, own_blocks = 0, [], {}, 1
        load = self.load
        snapshots: list[WorkerSnapshot] = []
        by_id: dict[int, InstanceInfo] = {}
        for info in candidates:
            by_id[info.instance_id] = info
            for rank in self._ranks.get(info.instance_id, (0,)):
                worker = (info.instance_id, rank)
                snapshots.append(
                    WorkerSnapshot(
                        worker,
                        matches.get(worker, 0),
                        load.prefill_tokens(worker),
                        load.decode_blocks(worker),
                        load.new_blocks(worker, hashes) + own_blocks,
                    )
                )
        settings = self.settings
        chosen = choose_worker(
            prompt_tokens,
            self.block_size,
            snapshots,
            overlap_score_weight=settings.overlap_score_weight,
            queued_prefill_weight=settings.queued_prefill_weight,
            temperature=settings.temperature,
            rng=self._rng,
        )
        assert chosen is not None  # there was at least one candidate
        worker = chosen.worker
        load.started(
            request.request_id, worker, prefill_tokens=chosen.prefill_tokens, hashes=hashes, own_blocks=own_blocks
        )
        if isinstance(self.indexer, PredictedKvIndexer) and hashes:
            self.indexer.record(worker, hashes)
        return Decision(by_id[worker[0]], worker[1], chosen.overlap_blocks, chosen.prefill_tokens)

    def prefill_done(self, request_id: str) -> None:
        self.load.prefill_done(request_id)

    def finished(self, request_id: str) -> None:
        self.load.finished(request_id)

    def busy(self, instance_id: int) -> bool:
        """Whether every dp rank of the instance is past a busy threshold (Dynamo's rule: a rank with room
        keeps the instance routable)."""
        usage, waiting = self.settings.busy_kv_usage, self.settings.busy_waiting
        if usage is None and waiting is None:
            return False
        load = self.load
        return all(
            load.busy((instance_id, rank), kv_usage=usage, waiting=waiting)
            for rank in self._ranks.get(instance_id, (0,))
        )

    def instance_added(self, instance: InstanceInfo) -> None:
        """Count ``instance`` in, and ask it for its cache (events mode)."""
        instance_id = instance.instance_id
        if instance_id in self._instances:
            return
        address = instance.address or self.address
        key = (address.namespace, address.component)
        component = self._components.get(key) or self._listen(address, home=False)
        component.instances.add(instance_id)
        self._component_of[instance_id] = key
        self._instances.add(instance_id)
        self._ranks.setdefault(instance_id, (0,))
        if self.settings.use_kv_events:
            self._ask_state((instance_id, 0))

    def instance_removed(self, instance_id: int) -> None:
        """Forget ``instance_id``: its blocks, its load, its ranks; its late events will be ignored."""
        self._instances.discard(instance_id)
        self._ranks.pop(instance_id, None)
        key = self._component_of.pop(instance_id, None)
        component = self._components.get(key) if key is not None else None
        if component is not None:
            component.instances.discard(instance_id)
            if not component.home and not component.instances:
                # Its last instance left: stop listening to it (in a task, owned like the others).
                del self._components[component.key]
                self._supervisor.own(component.supervisor.close, name=f"closing {component.name}", restart=False)
        self.indexer.remove_instance(instance_id)
        self.load.remove_instance(instance_id)
        for worker in [worker for worker in self._last_event if worker[0] == instance_id]:
            del self._last_event[worker]

    # -- what the router hears ------------------------------------------------------------------

    def _on_events(self, data: bytes, subject: str | None = None) -> None:
        try:
            batch = _decode_batch(data)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            self._malformed.report(
                f"a malformed KV event batch on {subject or self.address.kv_events_subject()}: {exc}"
            )
            return
        if batch.event_id < 0 or not 0 <= batch.dp_rank <= MAX_DP_RANK:
            self._malformed.report(f"a KV event batch with event_id {batch.event_id}, dp_rank {batch.dp_rank}")
            return
        if batch.instance_id not in self._instances:
            return  # not in this pool (yet, or any more): joining asks for the whole state anyway
        worker = (batch.instance_id, batch.dp_rank)
        self._note_rank(worker)
        if batch.event_id == 0:
            self._apply_state(worker, batch)
            return
        last = self._last_event.get(worker)
        if last is not None and last != _BASELINE and batch.event_id <= last:
            self.stale_batches += 1  # a duplicate, or one overtaken by a whole-state answer
            return
        if isinstance(self.indexer, KvIndexer):
            self.indexer.apply(worker, batch.events)
        self._last_event[worker] = batch.event_id
        expected = 1 if last is None else last + 1
        if last != _BASELINE and batch.event_id != expected:
            # Batches were lost (or this router came late): what they said is unknown, so ask for all of it.
            self.gaps += 1
            log.debug("KV events of %x rank %d jumped to %d (expected %d)", *worker, batch.event_id, expected)
            self._ask_state(worker)

    def _on_load(self, data: bytes, subject: str | None = None) -> None:
        try:
            report = _decode_load(data)
        except msgspec.DecodeError as exc:
            self._malformed.report(
                f"a malformed load report on {subject or self.address.load_metrics_subject()}: {exc}"
            )
            return
        if report.instance_id not in self._instances or not 0 <= report.dp_rank <= MAX_DP_RANK:
            return
        self._note_rank((report.instance_id, report.dp_rank))
        self.load.observe(report)

    def _note_rank(self, worker: Worker) -> None:
        """Route to dp ranks as they show up; a new rank is asked for its cache too."""
        instance_id, rank = worker
        ranks = self._ranks.get(instance_id, (0,))
        if rank in ranks:
            return
        self._ranks[instance_id] = tuple(sorted((*ranks, rank)))
        if self.settings.use_kv_events:
            self._ask_state(worker)

    def _apply_state(self, worker: Worker, batch: KvEventBatch) -> None:
        if isinstance(self.indexer, KvIndexer):
            self.indexer.replace(worker, batch.events)
        self.state_syncs += 1
        # The answer covers everything up to now: the next batch, whatever its id, continues from it.
        self._last_event[worker] = _BASELINE

    # -- asking a worker for its cache -----------------------------------------------------------

    def _ask_state(self, worker: Worker) -> None:
        if self._closed or worker in self._syncing:
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
            self.changed.set()

    async def _ask_for_state(self, worker: Worker) -> None:
        """Ask ``worker`` for its whole cache, a few times if it does not answer; apply the answer."""
        instance_id, rank = worker
        component = self._components.get(self._component_of.get(instance_id, ("", "")))
        address = component.address if component is not None else self.address
        subject = address.kv_state_subject(instance_id)
        payload = _encode(KvStateRequest(dp_rank=rank))
        why = "no answer"
        if component is not None and not component.home:
            # An answer that came before the events were heard would miss those in between.
            await component.confirmed(self._nc)
        for delay in (*STATE_RETRY_DELAYS_S, None):
            if instance_id not in self._instances:
                return
            try:
                reply = await self._nc.request(subject, payload, timeout=STATE_TIMEOUT_S)
            except nats.errors.Error as exc:
                why = type(exc).__name__
            else:
                self._on_state(worker, reply.data)
                return
            if delay is not None:
                await asyncio.sleep(delay)
        log.info(
            "instance %x rank %d did not send its KV cache state (%s): its cache is learned from its events only",
            instance_id, rank, why,
        )  # fmt: skip

    def _on_state(self, worker: Worker, data: bytes) -> None:
        try:
            batch = _decode_batch(data)
        except msgspec.DecodeError as exc:
            self._malformed.report(f"a malformed KV state answer from {worker[0]:x}: {exc}")
            return
        if (batch.instance_id, batch.dp_rank) != worker:
            self._malformed.report(f"a KV state answer for {batch.instance_id:x} rank {batch.dp_rank}, not {worker}")
            return
        if worker[0] in self._instances:
            self._apply_state(worker, batch)

    def _listen(self, address: EndpointAddress, *, home: bool) -> "_Component":
        """Start listening to the load reports (and KV events) of ``address``'s component."""
        component = _Component(address, home=home)
        self._components[component.key] = component
        if not home:
            log.info(
                "the KV router of %s listens to %s too (an instance of its pool serves there)", self.address, address
            )
        self._own_listener(component, address.load_metrics_subject(), self._on_load, "load reports")
        if self.settings.use_kv_events:
            self._own_listener(component, address.kv_events_subject(), self._on_events, "KV events")
        return component

    def _own_listener(
        self, component: "_Component", subject: str, handle: Callable[[bytes, str], None], what: str
    ) -> None:
        """Listen on ``subject`` in a task of ``component``'s supervisor (re-subscribing after a failure)."""
        subscribed = asyncio.Event()
        component.subscribed.append(subscribed)

        async def listen() -> None:
            subscription = await self._nc.subscribe(subject)
            subscribed.set()
            try:
                async for message in subscription.messages:
                    handle(message.data, subject)
                    self.changed.set()
            finally:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()

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


class _RateLimitedWarning:
    """Logs the first report at once, then at most one per ``period`` with how many were held back."""

    def __init__(self, period: float) -> None:
        self._period = period
        self._held = 0
        self._last = -math.inf
        self.count = 0

    def report(self, message: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last < self._period:
            self._held += 1
            return
        more = f" (and {self._held} more since the last report)" if self._held else ""
        log.warning("KV router ignored %s%s", message, more)
        self._held, self._last = 0, now
