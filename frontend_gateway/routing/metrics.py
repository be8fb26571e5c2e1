"""Prometheus metrics of the gateway's routing, per model: is the router's picture of the workers whole,
how good are its choices, and what did the fleet refuse or lose.

``RoutingCollectors`` are the metric families, registered in the gateway's registry (metrics.py);
``ModelRoutingMetrics`` is one model's ``RoutingHealth`` (routing/health.py), its labelled children
resolved once, so that a decision costs three histogram observations and no label lookup.

What each says, and what to do when it moves:

* ``flotilla_router_kv_event_gaps_total``: KV event batches that did not follow the last one heard from
  their worker (batches lost on the way, or published while NATS was away: the worker's
  ``flotilla_worker_kv_event_batches_lost_total`` counts those). Each costs a state sync. A steady rate
  means a congested or flapping NATS link.
* ``flotilla_router_kv_stale_batches_total``: duplicates, or batches overtaken by a whole-state answer.
* ``flotilla_router_kv_state_syncs_total``: whole-cache answers applied (one per instance joining, one
  per gap).
* ``flotilla_router_kv_malformed_messages_total``: KV events, load reports or state answers that did not
  decode: a worker of another version, or something else publishing on the fleet's subjects.
* ``flotilla_router_chosen_overlap_blocks`` / ``_ratio``: how much of each prompt the chosen worker
  held (token models); a ratio that falls while traffic shares prefixes means the index is blind.
* ``flotilla_router_cost_spread_blocks``: highest minus lowest candidate cost of each decision; near 0
  the choice hardly mattered, large ones mean unevenly loaded or cached workers.
* ``flotilla_router_busy_refusals_total``: requests answered 503 ``all_workers_busy``.
* ``flotilla_router_migrations_total{cause}``: requests moved to another worker mid-stream, by why
  their stream broke (``cut``, ``silent``, ``frames_lost``, ``stalled``).
* ``flotilla_router_disagg_decisions_total{path,reason}``: for a model with prefill workers, where each
  request's prompt was computed: ``remote`` (``policy``: on a prefill worker) or ``local`` (on its decode
  worker: ``isl``, little left to compute there; ``load``, every prefill worker has a step's worth queued;
  ``no_prefill``, no prefill worker routable; ``busy``, every one busy; ``prefill_failed``, the prefill
  workers tried failed); ``header`` either way when the request's ``x-flotilla-disagg`` said where, and
  ``decode_busy`` remote when the decode gate (``--disagg-decode-busy``) overruled a local verdict. A
  growing ``prefill_failed`` or ``busy`` share means the prefill group is short or failing.
* ``flotilla_router_deadline_expiries_total{deadline}``: streams that passed a request-plane deadline
  at this ingress (``progress``: no output for ``--progress-deadline``). The worker's side, the ack
  deadline, is the worker's ``flotilla_worker_ack_deadline_expiries_total``.
* ``flotilla_router_replica_sync_delay_seconds``: with ``--router-replica-sync``, how long the other
  router replicas' decisions took to reach this one (their wall clock to this one's, so across machines
  it includes clock skew). Decisions made in that window do not see each other: in simulated time
  (bench/routing_sim.py) 4 replicas lose 0.5% of one router's hit rate at 1.5 ms and 2.4% at 20 ms. A
  p50 of several ms means the ingress processes are short of CPU or NATS is far away.
"""

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

# Blocks of a prompt (and block costs): powers of two from one block to a 512k-token prompt in 16s.
_BLOCK_BUCKETS = (0.0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
# A NATS hop on one machine is about a millisecond; past a second a replica's decisions are long over.
_SYNC_DELAY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class RoutingCollectors:
    """The routing metric families, labelled by model (and cause or deadline)."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "flotilla_router") -> None:
        r = registry
        self.kv_event_gaps = Counter(
            f"{prefix}_kv_event_gaps",
            "KV event batches that did not follow the last one heard from their worker (batches were lost); "
            "each makes the router ask the worker for its whole cache.",
            ["model"],
            registry=r,
        )
        self.kv_stale_batches = Counter(
            f"{prefix}_kv_stale_batches",
            "KV event batches dropped as stale: duplicates, or overtaken by a whole-cache answer.",
            ["model"],
            registry=r,
        )
        self.kv_state_syncs = Counter(
            f"{prefix}_kv_state_syncs",
            "Whole-cache answers from workers applied to the router's index (on joining, and after a gap).",
            ["model"],
            registry=r,
        )
        self.kv_malformed = Counter(
            f"{prefix}_kv_malformed_messages",
            "KV event batches, load reports and cache answers ignored because they did not decode.",
            ["model"],
            registry=r,
        )
        self.chosen_overlap_blocks = Histogram(
            f"{prefix}_chosen_overlap_blocks",
            "Leading prompt blocks the chosen worker already held, per KV routing decision of a token model.",
            ["model"],
            buckets=_BLOCK_BUCKETS,
            registry=r,
        )
        self.chosen_overlap_ratio = Histogram(
            f"{prefix}_chosen_overlap_ratio",
            "Share (0..1) of the prompt's full blocks the chosen worker already held, per KV routing decision.",
            ["model"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.cost_spread_blocks = Histogram(
            f"{prefix}_cost_spread_blocks",
            "Highest minus lowest candidate cost (in KV blocks) of each KV routing decision (0 with one candidate).",
            ["model"],
            buckets=_BLOCK_BUCKETS,
            registry=r,
        )
        self.busy_refusals = Counter(
            f"{prefix}_busy_refusals",
            "Requests refused with 503 all_workers_busy: every instance was past a busy threshold or its own queue.",
            ["model"],
            registry=r,
        )
        self.migrations = Counter(
            f"{prefix}_migrations",
            "Requests moved to another instance after their stream broke, by cause (cut, silent, frames_lost, "
            "stalled).",
            ["model", "cause"],
            registry=r,
        )
        self.deadline_expiries = Counter(
            f"{prefix}_deadline_expiries",
            "Streams that passed a request-plane deadline at this ingress (progress: no output in time).",
            ["model", "deadline"],
            registry=r,
        )
        self.disagg_decisions = Counter(
            f"{prefix}_disagg_decisions",
            "Requests of a model with prefill workers by where their prompt was computed (path remote: a prefill "
            "worker; local: the decode worker) and why.",
            ["model", "path", "reason"],
            registry=r,
        )
        self.replica_sync_delay = Histogram(
            f"{prefix}_replica_sync_delay_seconds",
            "Seconds from another router replica sending a batch of its decisions to this router applying it "
            "(--router-replica-sync; wall clocks, so across machines it includes their skew).",
            ["model"],
            buckets=_SYNC_DELAY_BUCKETS,
            registry=r,
        )


class ModelRoutingMetrics:
    """One model's routing health, counted in Prometheus (a ``RoutingHealth``)."""

    __slots__ = (
        "_busy_refusals",
        "_cost_spread",
        "_deadlines",
        "_disagg",
        "_families",
        "_gaps",
        "_malformed",
        "_migrations",
        "_overlap_blocks",
        "_overlap_ratio",
        "_stale",
        "_sync_delay",
        "_syncs",
        "model",
    )

    def __init__(self, families: RoutingCollectors, model: str) -> None:
        self._families = families
        self.model = model
        self._gaps = families.kv_event_gaps.labels(model=model)
        self._stale = families.kv_stale_batches.labels(model=model)
        self._syncs = families.kv_state_syncs.labels(model=model)
        self._malformed = families.kv_malformed.labels(model=model)
        self._overlap_blocks = families.chosen_overlap_blocks.labels(model=model)
        self._overlap_ratio = families.chosen_overlap_ratio.labels(model=model)
        self._cost_spread = families.cost_spread_blocks.labels(model=model)
        self._busy_refusals = families.busy_refusals.labels(model=model)
        self._sync_delay = families.replica_sync_delay.labels(model=model)
        self._migrations: dict[str, Any] = {}
        self._deadlines: dict[str, Any] = {}
        self._disagg: dict[tuple[str, str], Any] = {}

    def gap(self) -> None:
        self._gaps.inc()

    def stale_batch(self) -> None:
        self._stale.inc()

    def state_sync(self) -> None:
        self._syncs.inc()

    def malformed(self) -> None:
        self._malformed.inc()

    def chosen(self, overlap_blocks: int, prompt_blocks: int, cost_spread: float) -> None:
        if prompt_blocks:
            self._overlap_blocks.observe(overlap_blocks)
            self._overlap_ratio.observe(overlap_blocks / prompt_blocks)
        self._cost_spread.observe(cost_spread)

    def busy_refusal(self) -> None:
        self._busy_refusals.inc()

    def migration(self, cause: str) -> None:
        child = self._migrations.get(cause)
        if child is None:
            child = self._migrations[cause] = self._families.migrations.labels(model=self.model, cause=cause)
        child.inc()

    def disagg_decision(self, path: str, reason: str) -> None:
        child = self._disagg.get((path, reason))
        if child is None:
            child = self._disagg[path, reason] = self._families.disagg_decisions.labels(
                model=self.model, path=path, reason=reason
            )
        child.inc()

    def deadline_expired(self, deadline: str) -> None:
        child = self._deadlines.get(deadline)
        if child is None:
            child = self._deadlines[deadline] = self._families.deadline_expiries.labels(
                model=self.model, deadline=deadline
            )
        child.inc()

    def replica_sync_delay(self, seconds: float) -> None:
        self._sync_delay.observe(seconds)
