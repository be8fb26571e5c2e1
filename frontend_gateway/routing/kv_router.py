"""The KV-aware router (``--router-mode kv``): each request to the worker where it costs least.

The router is an index and a decision. It hashes each request's prompt in blocks of the card's block
size, looks up which workers hold its leading blocks (kv_indexer.py), weighs their load (kv_load.py),
and scores the candidates with kv_scoring.py; ``choose`` is pure: no I/O, no awaiting.

What it knows comes from the workers through a ``KvEventSubscriber`` (frontend_gateway/routing/kv_subscriber.py, next to
the workers' publisher): their KV events and load reports, on the subjects of every component the pool's
instances serve, kept whole there (gaps and stale batches detected, workers asked for their whole cache
when they join or when batches were lost, malformed messages reported). The subscriber hands the
router only what to apply: events and whole-cache states to the index, load reports to the load. With
``use_kv_events`` off, no events are read: the index predicts the caches from the router's own
decisions (kv_indexer.PredictedKvIndexer), and only load reports are heard. With it on, an instance whose
registration says its engine publishes no events (llama.cpp, the echo engines) has its cache predicted
so, beside the others' real ones, rather than being routed on load alone.

Given a ``RoutingHealth`` (routing/health.py; the gateway's Prometheus counters), the subscriber tells
it of every repair it made, and the router, for each decision, of the chosen worker's overlap and the
spread of the candidates' costs.
"""

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence

from nats.aio.client import Client as NATS

from frontend_gateway.routing.health import RoutingHealth
from frontend_gateway.routing.kv_indexer import KvIndexer, PredictedKvIndexer, TieredMatch, Worker
from frontend_gateway.routing.kv_load import ActiveLoad
from frontend_gateway.routing.kv_scoring import WorkerSnapshot, pick, worker_costs
from frontend_gateway.routing.kv_subscriber import KvEventSubscriber
from frontend_gateway.routing.protocol import Decision, InstanceInfo, RouterMode, RouterSettings
from frontend_gateway.routing.replica_sync import ReplicaSync
from runtime.cluster.addressing import EndpointAddress
from runtime.kv.events import KvEvent, WorkerLoad
from runtime.kv.image_blocks import request_block_hashes
from runtime.lora import lora_root_hash
from runtime.protocol import PreprocessedRequest, TextRequest

log = logging.getLogger(__name__)

#: The longest answer a request is expected to write, for the blocks it will hold: ``max_tokens`` is an
#: upper bound, and a client that leaves it out gets the whole context left, which few answers fill.
EXPECTED_ANSWER_CAP_TOKENS = 512
NO_MATCH = TieredMatch(0)


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
        health: RoutingHealth | None = None,
        lora_id: int | None = None,
    ) -> None:
        """``lora_id``: the pool is a LoRA adapter's (runtime/lora.py): its requests' blocks chain from the
        adapter's root hash, and only its workers' blocks of that adapter are indexed. Raises ValueError for a
        block size below 1."""
        if block_size < 1:
            raise ValueError(f"the KV block size must be at least 1, not {block_size}")
        self.settings = settings
        self.block_size = block_size
        self.address = address
        self.lora_id = lora_id
        self._lora_root = lora_root_hash(lora_id)
        self._rng = random.Random(settings.seed)
        # The caches predicted from this router's decisions: every worker's with use_kv_events off, else
        # those of the instances whose engines publish no events (their registrations say so).
        self.predicted = PredictedKvIndexer(
            ttl_s=settings.predicted_ttl_s, max_blocks=settings.predicted_max_blocks, clock=clock
        )
        self.indexer: KvIndexer | PredictedKvIndexer = KvIndexer() if settings.use_kv_events else self.predicted
        self._predicting: set[int] = set()  # instances without events, in a pool routed on events
        self.load = ActiveLoad(clock=clock)
        self.subscriber = KvEventSubscriber(
            nc, address, self, use_kv_events=settings.use_kv_events, health=health, lora_id=lora_id
        )
        self._health = health
        # The dp ranks of each instance in the pool, as the subscriber saw them (0 until others show up).
        self._ranks: Mapping[int, tuple[int, ...]] = self.subscriber.ranks
        # The pool's routers in other ingress processes: their decisions load this one's workers too.
        self.replica_sync = ReplicaSync(
            nc=nc, address=address, block_size=block_size, load=self.load, predict=self._predict,
            in_pool=self._ranks.__contains__, enabled=settings.replica_sync, on_message=self.changed.set,
            on_delay=None if health is None else health.replica_sync_delay, clock=clock,
        )  # fmt: skip

    @property
    def changed(self) -> asyncio.Event:
        """Set after every message the router hears (tests await it)."""
        return self.subscriber.changed

    @property
    def gaps(self) -> int:
        return self.subscriber.gaps

    @property
    def stale_batches(self) -> int:
        return self.subscriber.stale_batches

    @property
    def state_syncs(self) -> int:
        return self.subscriber.state_syncs

    async def start(self) -> None:
        """Listen to the load reports (and KV events) of the pool's first component, once NATS has the
        subscriptions; that component is listened to until ``close``."""
        await self.subscriber.start()
        await self.replica_sync.start()

    async def close(self) -> None:
        """Stop listening and asking; the router is not used afterwards."""
        await self.replica_sync.close()
        await self.subscriber.close()

    def choose(self, request: PreprocessedRequest | TextRequest, candidates: Sequence[InstanceInfo]) -> Decision | None:
        """The candidate (and dp rank) where ``request`` costs least; None when there is no candidate."""
        if not candidates:
            return None
        if isinstance(request, PreprocessedRequest):
            # Each image is as many tokens as the engine widens it to (where the gateway knows).
            prompt_tokens = len(request.token_ids) + sum(
                image.tokens - 1 for image in request.images or () if image.tokens
            )
            # A prompt's images are named in the blocks that hold them, as the engine names them.
            hashes = request_block_hashes(request.token_ids, request.images, self.block_size, self._lora_root)
            matches = self._matches(hashes)
            # Its last partial block and its answer's blocks are its own wherever it goes.
            answer = min(request.stop_conditions.max_tokens, EXPECTED_ANSWER_CAP_TOKENS)
            own_blocks = math.ceil((prompt_tokens % self.block_size + answer) / self.block_size)
        else:  # a text engine tokenizes for itself: no blocks to match; one block each, to spread by count
            prompt_tokens, hashes, own_blocks = 0, [], 1
            matches = {}
        load = self.load
        snapshots: list[WorkerSnapshot] = []
        by_id: dict[int, InstanceInfo] = {}
        for info in candidates:
            by_id[info.instance_id] = info
            for rank in self._ranks.get(info.instance_id, (0,)):
                worker = (info.instance_id, rank)
                hit = matches.get(worker, NO_MATCH)
                snapshots.append(
                    WorkerSnapshot(
                        worker,
                        hit.device,
                        load.prefill_tokens(worker),
                        load.decode_blocks(worker),
                        load.new_blocks(worker, hashes) + own_blocks,
                        hit.host,
                        hit.far,
                    )
                )
        settings = self.settings
        scored = worker_costs(
            prompt_tokens,
            self.block_size,
            snapshots,
            overlap_score_weight=settings.overlap_score_weight,
            queued_prefill_weight=settings.queued_prefill_weight,
            host_hit_weight=settings.host_hit_weight,
            disk_hit_weight=settings.disk_hit_weight,
        )
        chosen = pick(scored, temperature=settings.temperature, rng=self._rng)
        if self._health is not None:
            costs = [entry.cost for entry in scored]
            self._health.chosen(chosen.overlap_blocks, len(hashes), max(costs) - min(costs))
        worker = chosen.worker
        load.started(
            request.request_id, worker, prefill_tokens=chosen.prefill_tokens, hashes=hashes, own_blocks=own_blocks
        )
        self._predict(worker, hashes)
        self.replica_sync.routed(
            request.request_id, worker, prefill_tokens=chosen.prefill_tokens, hashes=hashes, own_blocks=own_blocks
        )
        return Decision(
            by_id[worker[0]],
            worker[1],
            chosen.overlap_blocks,
            chosen.prefill_tokens,
            mode=RouterMode.KV,
            prompt_blocks=len(hashes),
            cost=chosen.cost,
            candidates=len(scored),
        )

    def _matches(self, hashes: Sequence[int]) -> dict[Worker, TieredMatch]:
        """Each worker's leading run of ``hashes``, on each tier of its cache (predicted caches: all on the
        device)."""
        indexer = self.indexer
        if isinstance(indexer, KvIndexer):
            matches = indexer.find_tiered(hashes)
        else:
            matches = {worker: TieredMatch(blocks) for worker, blocks in indexer.find_matches(hashes).items()}
        if self._predicting:
            for worker, blocks in self.predicted.find_matches(hashes).items():
                if worker[0] in self._predicting:
                    matches[worker] = TieredMatch(blocks)
        return matches

    def _predict(self, worker: Worker, hashes: Sequence[int]) -> None:
        """A prompt of blocks ``hashes`` was routed to ``worker`` (by this router or a replica): record them
        where that worker's cache is predicted (every worker's with use_kv_events off, else those whose
        engines publish no events); KV events tell the others."""
        if hashes and (self.indexer is self.predicted or worker[0] in self._predicting):
            self.predicted.record(worker, hashes)

    def prefill_done(self, request_id: str) -> None:
        self.load.prefill_done(request_id)
        self.replica_sync.prefill_done(request_id)

    def finished(self, request_id: str) -> None:
        self.load.finished(request_id)
        self.replica_sync.finished(request_id)

    def kv_usage(self, instance_id: int, dp_rank: int | None) -> float | None:
        return self.load.kv_usage((instance_id, dp_rank or 0))

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
        """Count ``instance`` in: its component is listened to, and it is asked for its cache (events mode);
        one whose engine publishes no events has its cache predicted from this router's decisions."""
        if self.settings.use_kv_events and not instance.kv_events and instance.instance_id not in self._predicting:
            self._predicting.add(instance.instance_id)
            log.info(
                "instance %s of %s publishes no KV events: its cache is predicted from this router's decisions",
                instance.name, self.address,
            )  # fmt: skip
        self.subscriber.instance_added(instance.instance_id, instance.address, kv_events=instance.kv_events)

    def instance_removed(self, instance_id: int) -> None:
        """Forget ``instance_id``: its blocks, its load, its ranks; its late events will be ignored."""
        self.subscriber.instance_removed(instance_id)
        self.indexer.remove_instance(instance_id)
        if instance_id in self._predicting:
            self._predicting.discard(instance_id)
            self.predicted.remove_instance(instance_id)
        self.load.remove_instance(instance_id)

    # -- what the subscriber hands over (frontend_gateway/routing/kv_subscriber.py KvEventTarget) -------------------

    def apply_events(self, worker: Worker, events: list[KvEvent]) -> None:
        if isinstance(self.indexer, KvIndexer):
            self.indexer.apply(worker, events)

    def replace_state(self, worker: Worker, events: list[KvEvent]) -> None:
        if isinstance(self.indexer, KvIndexer):
            self.indexer.replace(worker, events)

    def observe_load(self, report: WorkerLoad) -> None:
        self.load.observe(report)
