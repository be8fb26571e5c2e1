"""The reconciler: one pass that moves the fleet towards the desired state, run over and over.

A pass, in order (each step is an action of its own: audited, idempotent, safe beside a second pass):

1. Nodes whose last heartbeat is older than ``node_timeout_s`` go offline: nothing new is placed there,
   and their instances keep running as they were. Silence is not death: an agent may be cut off from
   the control plane (or the control plane from everyone, during its own outage) while its workers
   serve. Only a node silent for ``evict_after_s`` (minutes) is evicted: what ran or was about to start
   there fails ("node X stopped heartbeating at T"), to be placed elsewhere, and what was stopping is
   stopped. Two guards keep an outage from looking like a dead fleet:

   * the disruption guard: when more than ``disruption_share`` of the nodes that run something are
     silent at once, none is evicted (the likelier cause is the control plane's own network, Redis, or
     a slow upgrade, not most of the machines dying together), as Kubernetes stops evicting in a
     zone that is mostly unhealthy;
   * the worker's word: a worker whose signed liveness claim in etcd is recent (runtime/fleet_contract/
     liveness.py: signed under its instance's worker key, dated within ``liveness_window_s``) is alive, so
     its instance is not evicted, whatever its agent's silence; and when etcd cannot be asked, nobody is.

   The evicted workers that may still run (a dead agent, a live machine) are fenced in etcd with fences signed
   under their instances' worker keys (runtime/fleet_contract/fences.py), so they deregister and exit instead
   of serving beside their replacements.
   Then deadlines: a start nobody took after ``max_dispatches`` sends, a download with no progress for
   ``download_stall_s``, a worker not ready ``start_deadline_s`` after it started: each fails, with why;
   a stop not confirmed after ``max_dispatches`` sends is taken as done, its worker fenced.
   Then replaced instances retire: one whose replacement (a drain's, a one-replica restart's) is ready
   is stopped, so that a group never runs short while its instances move.
2. Failed instances of running pipelines whose backoff has passed go back to pending, unplaced
   (restarts + 1), to be placed wherever they fit now. The backoff grows with the instance's failure
   streak: 0 s after a node loss alone, then 1, 2, 4 … up to ``backoff_max_s``. Past ``max_restarts``
   failures in a row an instance stays failed: "gave up after N restarts: <last reason>".
3. Groups short of their replica count get new instances (``keep_replica_counts``); each group with
   instances of an older configuration has one more of them replaced (``roll_out_updates``); pending
   instances are placed (``place_pending_instances``); those that fit nowhere keep their reason.
4. Placed pending instances get a StartInstance on their node's queue, stopping ones a StopInstance, when
   nothing was sent for their current state yet, or it was sent ``resend_after_s`` ago and the agent has
   not reported since (a lost or expired message). Tasks expire after the same time, so an agent that
   comes back late does not act on stale orders. Stops go first: they free GPUs.

Passes never overlap: a pass holds the ``reconciler`` lease (a row, so SQLite and PostgreSQL alike), and
one that finds it taken asks the holder to run once more, so a request made during a pass is not lost.
Each step stays correct without the lease too (conditional updates), which is what makes it safe when a
lease expires under a slow pass.
"""

import asyncio
import copy
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import msgspec
from django.db.models import Count, Max, Q

from controlplane.accounts.task_keys import node_worker_key_sources
from controlplane.audit.records import Actor
from controlplane.database import db_now
from controlplane.deployments import evacuation, upkeep
from controlplane.deployments.dispatch import Dispatcher, DispatchError
from controlplane.deployments.instance_states import LIVE_STATES, InstanceState
from controlplane.deployments.kv_tiers import HostTierRefused
from controlplane.deployments.models import Instance, Lease, Pipeline
from controlplane.deployments.placement import Placement
from controlplane.deployments.worker_specs import adapters_message, start_message, stop_message
from controlplane.errors import Conflict
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Node
from controlplane.health.records import record_pass
from runtime.backoff import exponential_delay
from runtime.config import env_float, env_int, env_str
from runtime.errors import ConfigError, FlotillaError
from runtime.fleet_contract.fences import FenceTarget, put_fences
from runtime.fleet_contract.liveness import WINDOW_S, BadClaim, ask_for_claims, check_claim, read_claims
from runtime.fleet_contract.tasks import TASK_SET_ADAPTERS, TASK_START_INSTANCE, TASK_STOP_INSTANCE
from runtime.fleet_contract.worker_keys import worker_keys
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

LEASE_NAME = "reconciler"
ACTOR = Actor.system("reconciler")
# States of an instance that has (or is about to have) a process on its node.
_ON_NODE_STATES = [
    InstanceState.PENDING,
    InstanceState.DOWNLOADING,
    InstanceState.STARTING,
    InstanceState.READY,
    InstanceState.STOPPING,
]
# Passes run every 2 s: a held eviction is said once a minute, not thirty times.
_hold_log = RateLimitedLog(log, period_s=60.0)
_spare_log = RateLimitedLog(log, period_s=60.0)
# Each refused liveness claim is said at debug level too: the first of a minute hides the others' details.
_claim_log = RateLimitedLog(log, period_s=60.0, held_level=logging.DEBUG)


def _silent_since(node: Node) -> datetime | None:
    """Since when the node's silence counts: its last heartbeat, or a later restart of the count."""
    moments = [moment for moment in (node.last_heartbeat_at, node.silence_counted_from) if moment is not None]
    return max(moments) if moments else None


@dataclass(frozen=True, kw_only=True)
class ReconcilerSettings:
    """The reconciler's timings, each from a ``FLOTILLA_*`` variable (``from_env``)."""

    interval_s: float = 2.0  # FLOTILLA_RECONCILE_S: between passes
    node_timeout_s: float = 15.0  # FLOTILLA_NODE_TIMEOUT_S: three missed 5 s heartbeats, then offline
    evict_after_s: float = 300.0  # FLOTILLA_NODE_EVICT_S: silent this long, a node's instances move
    # FLOTILLA_DISRUPTION_SHARE: more than this share of the occupied nodes silent at once: evict none
    disruption_share: float = 0.5
    # FLOTILLA_NODE_EVICTION_INTERVAL_S: at most one node evicted per this many seconds (Kubernetes: 0.1/s)
    eviction_interval_s: float = 10.0
    resend_after_s: float = 30.0  # FLOTILLA_DISPATCH_RESEND_S: a task unanswered this long is sent again
    backoff_max_s: float = 60.0  # FLOTILLA_RESTART_BACKOFF_MAX_S
    max_restarts: int = 10  # FLOTILLA_MAX_RESTARTS: failures in a row restarted before giving up
    stop_grace_s: float = 30.0  # FLOTILLA_STOP_GRACE_S: a stopping worker's time to drain before SIGKILL
    max_dispatches: int = 5  # FLOTILLA_MAX_DISPATCHES: starts sent unanswered before the instance fails
    download_stall_s: float = 600.0  # FLOTILLA_DOWNLOAD_STALL_S: a download with no progress this long fails
    start_deadline_s: float = 1800.0  # FLOTILLA_START_DEADLINE_S: a worker not ready this long after starting
    lease_s: float = 10.0  # a pass's lease, renewed at each step; a crashed pass's frees itself after it
    # FLOTILLA_LIVENESS_WINDOW_S: a worker's liveness claim counts this long either side of its date
    liveness_window_s: float = WINDOW_S
    # ETCD_ENDPOINTS: where the workers are registered, to fence those of offline nodes; none: no fencing
    etcd_endpoints: tuple[str, ...] = ()

    @classmethod
    def from_env(cls) -> "ReconcilerSettings":
        """The settings the environment gives. Raises ConfigError naming a malformed variable."""
        settings = cls(
            interval_s=env_float("FLOTILLA_RECONCILE_S", cls.interval_s, minimum=0.1),
            node_timeout_s=env_float("FLOTILLA_NODE_TIMEOUT_S", cls.node_timeout_s, minimum=1.0),
            evict_after_s=env_float("FLOTILLA_NODE_EVICT_S", cls.evict_after_s, minimum=1.0),
            disruption_share=env_float("FLOTILLA_DISRUPTION_SHARE", cls.disruption_share, minimum=0.0),
            eviction_interval_s=env_float("FLOTILLA_NODE_EVICTION_INTERVAL_S", cls.eviction_interval_s, minimum=0.0),
            resend_after_s=env_float("FLOTILLA_DISPATCH_RESEND_S", cls.resend_after_s, minimum=1.0),
            backoff_max_s=env_float("FLOTILLA_RESTART_BACKOFF_MAX_S", cls.backoff_max_s, minimum=0.0),
            max_restarts=env_int("FLOTILLA_MAX_RESTARTS", cls.max_restarts, minimum=0),
            stop_grace_s=env_float("FLOTILLA_STOP_GRACE_S", cls.stop_grace_s, minimum=0.0),
            max_dispatches=env_int("FLOTILLA_MAX_DISPATCHES", cls.max_dispatches, minimum=1),
            download_stall_s=env_float("FLOTILLA_DOWNLOAD_STALL_S", cls.download_stall_s, minimum=1.0),
            start_deadline_s=env_float("FLOTILLA_START_DEADLINE_S", cls.start_deadline_s, minimum=1.0),
            liveness_window_s=env_float("FLOTILLA_LIVENESS_WINDOW_S", cls.liveness_window_s, minimum=1.0),
            etcd_endpoints=tuple(part.strip() for part in (env_str("ETCD_ENDPOINTS") or "").split(",") if part.strip()),
        )
        if settings.evict_after_s < settings.node_timeout_s:
            raise ConfigError(
                f"FLOTILLA_NODE_EVICT_S={settings.evict_after_s:g} is shorter than FLOTILLA_NODE_TIMEOUT_S="
                f"{settings.node_timeout_s:g}: a node is evicted only after it went offline"
            )
        if settings.disruption_share > 1:
            raise ConfigError(f"FLOTILLA_DISRUPTION_SHARE={settings.disruption_share:g} is a share: 0 to 1")
        return settings

    def resend_s(self, task: str) -> float:
        """Seconds before an unanswered ``task`` is sent again (and after which a sent one expires). A stop
        waits out the worker's grace as well: its agent reports "stopped" only once the worker has ended."""
        if task == TASK_STOP_INSTANCE:
            return self.stop_grace_s + self.resend_after_s
        return self.resend_after_s

    def backoff_s(self, failure_streak: int) -> float:
        """Seconds a failed instance waits before it is started again."""
        return exponential_delay(failure_streak, first_s=1.0, max_s=self.backoff_max_s)


@dataclass
class PassReport:
    """What one pass (or one run of passes) did."""

    nodes_offline: list[str] = field(default_factory=list)
    instances_lost: int = 0
    spared: int = 0  # instances of evicted nodes kept because their worker claims (signed) to be alive
    evictions_held: str = ""  # why silent nodes past their eviction time were not evicted
    fenced: int = 0
    overdue: int = 0  # instances failed for a deadline: a start nobody took, a stalled download or start
    replaced: int = 0  # instances added to keep a group at its replica count
    retired: int = 0  # instances stopped because their replacement is ready
    rolled: int = 0  # outdated instances replaced (or restarted in place) by a rolling update
    restarted: int = 0
    gave_up: int = 0
    placed: int = 0
    unplaceable: int = 0
    started: int = 0
    stopped: int = 0
    adapter_sets: int = 0  # SetAdapters tasks sent (a changed set, or the periodic re-send)
    dispatch_error: str = ""

    @property
    def changed(self) -> bool:
        counts = (
            self.instances_lost,
            self.overdue,
            self.replaced,
            self.retired,
            self.rolled,
            self.restarted,
            self.gave_up,
            self.placed,
            self.started,
            self.stopped,
        )
        return bool(self.nodes_offline or self.dispatch_error or any(counts))

    def summary(self) -> str:
        """One line for a log: only what happened."""
        parts = [f"nodes offline: {', '.join(self.nodes_offline)}"] if self.nodes_offline else []
        counts = {
            "lost with their node": self.instances_lost,
            "kept (worker signs it is alive)": self.spared,
            "overdue": self.overdue,
            "replicas replaced": self.replaced,
            "retired (replacement ready)": self.retired,
            "rolled out": self.rolled,
            "workers fenced": self.fenced,
            "restarted": self.restarted,
            "given up": self.gave_up,
            "placed": self.placed,
            "unplaceable": self.unplaceable,
            "started": self.started,
            "stopped": self.stopped,
            "adapter sets sent": self.adapter_sets,
        }
        parts += [f"{name}: {count}" for name, count in counts.items() if count]
        if self.evictions_held:
            parts.append(f"evictions held: {self.evictions_held}")
        if self.dispatch_error:
            parts.append(f"dispatch failed: {self.dispatch_error}")
        return "; ".join(parts) or "nothing to do"

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


class LeaseLost(Exception):
    """The pass was slower than its lease and another pass took it over."""


class Reconciler:
    """Runs passes with ``dispatcher`` carrying the tasks; ``clock`` is the time: by default the database's,
    the clock heartbeats are stamped with (``db_now``), so no process's own clock is compared with another's
    (tests move it)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        settings: ReconcilerSettings | None = None,
        *,
        clock: Callable[[], datetime] = db_now,
    ) -> None:
        self.dispatcher = dispatcher
        self.settings = settings or ReconcilerSettings.from_env()
        self.clock = clock
        self._holder = ""
        # (pipeline id, node name) -> the adapter generation last sent there, and when (``send_adapter_sets``).
        self._adapter_sets_sent: dict[tuple[int, str], tuple[int, datetime]] = {}

    def run_once(self) -> PassReport | None:
        """One pass under the lease, and more while others asked for one meanwhile.

        Returns None (and asks the holder for another pass) when another pass is running.
        """
        holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        if not Lease.acquire(LEASE_NAME, holder, self.clock(), self._lease_ttl):
            log.debug("another reconciler pass is running; it will run once more")
            return None
        self._holder = holder
        started = time.monotonic()
        report = PassReport()
        try:
            while True:
                self.reconcile(report)
                if Lease.release(LEASE_NAME, holder, self.clock()):
                    break
        except LeaseLost:
            log.warning("a reconciler pass outlasted its lease (%g s) and stopped early", self.settings.lease_s)
        finally:
            self._holder = ""
            Lease.release(LEASE_NAME, holder, self.clock())
        log.log(logging.INFO if report.changed else logging.DEBUG, "reconciler pass: %s", report.summary())
        record_pass(LEASE_NAME, started, report.summary())  # for /api/v1/health/, /metrics and the banner
        return report

    def reconcile(self, report: PassReport | None = None) -> PassReport:
        """The four steps, without the lease (``run_once`` takes it). Raises LeaseLost when the lease of
        the pass was taken over."""
        report = report if report is not None else PassReport()
        self._renew()
        self.fail_lost_nodes(report)
        self._renew()
        self.fail_overdue(report)
        self._renew()
        report.retired += evacuation.retire_replaced_instances(ACTOR)
        self._renew()
        self.restart_failed(report)
        self._renew()
        report.replaced += len(upkeep.keep_replica_counts(ACTOR))
        self._renew()
        report.rolled += upkeep.roll_out_updates(ACTOR)
        self._renew()
        self.place(report)
        self._renew()
        self.dispatch(report)
        self._renew()
        self.send_adapter_sets(report)
        return report

    def fail_lost_nodes(self, report: PassReport) -> None:
        """Step 1: silent nodes offline; those silent past the eviction time evicted, unless a guard holds."""
        now = self.clock()
        silent_since = now - timedelta(seconds=self.settings.node_timeout_s)
        for node in Node.objects.filter(state=Node.State.ONLINE, last_heartbeat_at__lt=silent_since):
            if fleet_actions.mark_node_offline(ACTOR, node, silent_since):
                report.nodes_offline.append(node.name)
        occupied = list(
            Node.objects.filter(state=Node.State.OFFLINE, instances__state__in=_ON_NODE_STATES)
            .distinct()
            .order_by("name")
        )
        self._ask_for_claims(occupied)
        evict_before = now - timedelta(seconds=max(self.settings.evict_after_s, self.settings.node_timeout_s))
        due = [node for node in occupied if (since := _silent_since(node)) is None or since < evict_before]
        if not due:
            return
        if held := self._disruption(occupied):
            report.evictions_held = held
            _hold_log.warning(held)
            # Silence while evictions are held is not counted against a node: once the disruption ends, those
            # still silent get a whole eviction time from then, not evicted in one pass the moment the share
            # drops (Kubernetes resets its timers on leaving full disruption; the control plane's own outage
            # looks like every node silent at once).
            Node.objects.filter(pk__in=[node.pk for node in occupied]).update(silence_counted_from=now)
            return
        alive = self._live_workers(due)
        if alive is None:
            report.evictions_held = "etcd cannot say which of their workers are alive"
            return
        last_eviction = Node.objects.aggregate(last=Max("evicted_at"))["last"]
        interval = timedelta(seconds=self.settings.eviction_interval_s)
        for position, node in enumerate(due):
            if last_eviction is not None and now < last_eviction + interval:
                waiting = ", ".join(waiting_node.name for waiting_node in due[position:])
                report.evictions_held = (
                    f"one node evicted every {self.settings.eviction_interval_s:g} s "
                    f"(FLOTILLA_NODE_EVICTION_INTERVAL_S): {waiting} waits"
                )
                _hold_log.warning(f"silent nodes past their eviction time: {report.evictions_held}")
                return
            lost = evacuation.evacuate_offline_node(ACTOR, node, spare_workers=alive)
            if lost:
                Node.objects.filter(pk=node.pk).update(evicted_at=now)
                last_eviction = now
            report.instances_lost += len(lost)
            report.fenced += self.fence(node, lost)
            spared = list(
                Instance.objects.filter(
                    node=node, state__in=_ON_NODE_STATES, endpoint_instance_id__in=alive
                ).values_list("endpoint_instance_id", flat=True)
            )
            if spared:
                report.spared += len(spared)
                _spare_log.warning(
                    f"node {node.name} is silent past its eviction time, but its workers sign that they are alive: "
                    f"not evicted ({', '.join(f'{worker_id:x}' for worker_id in spared)}); its agent is cut off "
                    "from the control plane, or dead while its workers serve on"
                )

    def _disruption(self, silent: list[Node]) -> str:
        """Why no node may be evicted now (too many silent at once), or "" when evicting is safe."""
        # The nodes that run something, and the idle ones that could take what the silent ones run (GPU nodes for
        # silent GPU nodes, CPU nodes for CPU ones): idle nodes of another kind would water the share down (two
        # silent GPU nodes beside three idle CPU ones are every GPU node silent, not 40% of the fleet), while an
        # idle spare of the same kind is where the silent node's replicas would go.
        silent_kinds = {node.gpus.exists() for node in silent}
        counted = Node.objects.filter(state=Node.State.ONLINE).annotate(
            gpu_count=Count("gpus", distinct=True),
            running=Count("instances", filter=Q(instances__state__in=_ON_NODE_STATES), distinct=True),
        )
        online = sum(1 for node in counted if node.running or (node.gpu_count > 0) in silent_kinds)
        share = len(silent) / (online + len(silent))
        if share <= self.settings.disruption_share:
            return ""
        return (
            f"{len(silent)} of the {online + len(silent)} nodes that run or could take instances are silent at once "
            f"({share:.0%}, more than FLOTILLA_DISRUPTION_SHARE={self.settings.disruption_share:g}): more "
            "likely the control plane's own outage or a partition than dead machines, so none is evicted; "
            "their instances stay where they are until their agents report again"
        )

    def _ask_for_claims(self, silent: list[Node]) -> None:
        """Ask the workers of the offline nodes ``silent`` to sign that they are alive, and no others: by their
        node's eviction time, those alive have (runtime/fleet_contract/liveness.py). Nothing is asked while no
        node is offline: the requests left expire on their own."""
        if not self.settings.etcd_endpoints or not silent:
            return
        on_silent = Instance.objects.filter(node__in=silent, state__in=_ON_NODE_STATES)
        workers = [worker for worker in on_silent.values_list("endpoint_instance_id", flat=True) if worker is not None]
        try:
            asyncio.run(ask_for_claims(list(self.settings.etcd_endpoints), workers))
        except FlotillaError as exc:
            _hold_log.warning(f"{exc}: the workers of the offline nodes cannot prove that they are alive meanwhile")

    def _live_workers(self, nodes: list[Node]) -> set[int] | None:
        """The worker ids of ``nodes``' instances that prove in etcd that they are alive (a signed, recent
        liveness claim); empty when no etcd is configured (nothing to ask), None when it is configured and does
        not answer (then nobody may be evicted: silence is not death)."""
        if not self.settings.etcd_endpoints:
            return set()
        try:
            claims = asyncio.run(read_claims(list(self.settings.etcd_endpoints)))
        except FlotillaError as exc:
            _hold_log.warning(f"{exc}: no silent node is evicted until it answers")
            return None
        now = self.clock().timestamp()
        alive = set()
        for node in nodes:
            on_node = Instance.objects.filter(node=node, state__in=_ON_NODE_STATES, endpoint_instance_id__isnull=False)
            ids = on_node.values_list("pk", "endpoint_instance_id")
            claimed = [(pk, worker_id) for pk, worker_id in ids if worker_id in claims]
            node_keys = node_worker_key_sources(node.name) if claimed else []
            for pk, worker_id in claimed:
                keys = worker_keys(node_keys, pk)
                try:
                    check_claim(
                        claims[worker_id],
                        instance_id=pk,
                        worker_id=worker_id,
                        keys=keys,
                        now=now,
                        window_s=self.settings.liveness_window_s,
                    )
                except BadClaim as exc:
                    # Someone else's forgery, or a worker started under a revoked token: evicted all the same.
                    _claim_log.warning(
                        f"the liveness claim of worker {worker_id:x} (instance {pk} on silent node {node.name}) is "
                        f"not believed: {exc}"
                    )
                    continue
                alive.add(worker_id)
        return alive

    def fence(self, node: Node, lost: list[Instance], reason: str = "") -> int:
        """Fence the workers of ``lost``, instances of ``node`` (offline, unless ``reason`` says otherwise);
        returns how many were fenced.

        Failing to (no etcd configured, or none answering) is logged with its consequence; the pass
        goes on, as the replacements are placed either way.
        """
        targets = [FenceTarget(i.pk, i.endpoint_instance_id) for i in lost if i.endpoint_instance_id]
        if not targets:
            return 0
        ids = ", ".join(f"{target.worker_id:x}" for target in targets)
        if not self.settings.etcd_endpoints:
            log.warning(
                "cannot fence the workers of offline node %s (%s): ETCD_ENDPOINTS is not set for the control "
                "plane; if they still run, they serve beside their replacements until their agent returns",
                node.name,
                ids,
            )
            return 0
        node_keys = node_worker_key_sources(node.name)
        if not node_keys:
            log.warning(
                "node %s has no agent token: the fences of its workers (%s) carry no signature, so the workers "
                "its agent started ignore them",
                node.name,
                ids,
            )
        reason = reason or f"node {node.name} stopped heartbeating; the control plane placed this replica elsewhere"
        try:
            asyncio.run(put_fences(list(self.settings.etcd_endpoints), targets, reason, node_keys))
        except FlotillaError as exc:
            log.error(
                "%s: the workers of offline node %s (%s) may serve until their agent returns",
                exc,
                node.name,
                ids,
            )
            return 0
        return len(targets)

    def fail_overdue(self, report: PassReport) -> None:
        """Step 1b: instances on online nodes that wait past a deadline fail with the reason (and are
        restarted as any failure is): a start sent ``max_dispatches`` times with no answer, a download with
        no progress for ``download_stall_s``, a worker not ready ``start_deadline_s`` after it started."""
        now = self.clock()
        settings = self.settings
        on_online = Instance.objects.select_related("pipeline", "group", "node").filter(node__state=Node.State.ONLINE)
        unanswered = on_online.filter(
            state=InstanceState.PENDING,
            dispatches__gte=settings.max_dispatches,
            dispatched_at__lte=now - timedelta(seconds=settings.resend_after_s),
        )
        stalled = on_online.filter(
            state=InstanceState.DOWNLOADING, updated_at__lte=now - timedelta(seconds=settings.download_stall_s)
        )
        slow = on_online.filter(
            state=InstanceState.STARTING, state_changed_at__lte=now - timedelta(seconds=settings.start_deadline_s)
        )
        for instance in unanswered.order_by("id"):
            node = instance.node
            assert node is not None
            waited = settings.max_dispatches * settings.resend_after_s
            reason = (
                f"node {node.name}'s agent took none of {instance.dispatches} starts sent over {waited:g} s (it "
                f"heartbeats, but does not consume its task queue node.{node.name}: see its log)"
            )
            report.overdue += upkeep.fail_overdue_instance(ACTOR, instance, reason)
        for instance in stalled.order_by("id"):
            reason = f"its download reported no progress for {settings.download_stall_s:g} s"
            report.overdue += upkeep.fail_overdue_instance(ACTOR, instance, reason)
        for instance in slow.order_by("id"):
            reason = f"its worker did not become ready within {settings.start_deadline_s:g} s of starting"
            report.overdue += upkeep.fail_overdue_instance(ACTOR, instance, reason)
        self._end_unconfirmed_stops(on_online, now, report)

    def _end_unconfirmed_stops(self, on_online: Any, now: datetime, report: PassReport) -> None:
        """Stopping has a deadline: a stop sent ``max_dispatches`` times that the node's agent never confirmed
        (it heartbeats but does not act: a stuck agent, a clock it judged the stops by wrongly) is taken as done,
        and its worker fenced in etcd, so that a drain or a rolling update waiting on it moves on."""
        settings = self.settings
        resend_s = settings.resend_s(TASK_STOP_INSTANCE)
        unconfirmed = on_online.filter(
            state=InstanceState.STOPPING,
            dispatches__gte=settings.max_dispatches,
            dispatched_at__lte=now - timedelta(seconds=resend_s),
        )
        for instance in unconfirmed.order_by("id"):
            node = instance.node
            assert node is not None
            as_it_was = copy.copy(instance)  # its worker id, which a restart's fresh start clears
            waited = settings.max_dispatches * resend_s
            reason = (
                f"node {node.name}'s agent confirmed none of {instance.dispatches} stops sent over {waited:g} s: "
                "taken as stopped, and its worker fenced (see the agent's log)"
            )
            if upkeep.end_unconfirmed_stop(ACTOR, instance, reason):
                report.overdue += 1
                report.fenced += self.fence(node, [as_it_was], reason=f"instance {instance.pk}: {reason}")

    def restart_failed(self, report: PassReport) -> None:
        """Step 2: failed instances back to pending once their backoff passed, or given up."""
        now = self.clock()
        limit = self.settings.max_restarts
        # One whose replacement is under way is not restarted: it is stopped (``retire_replaced_instances``).
        failed = (
            Instance.objects.select_related("pipeline", "group")
            .filter(state=InstanceState.FAILED, pipeline__state=Pipeline.State.RUNNING)
            .exclude(replacements__state__in=LIVE_STATES)
        )
        for instance in failed.filter(failure_streak__gt=limit, gave_up=False).order_by("id"):
            report.gave_up += upkeep.give_up_instance(ACTOR, instance, limit)
        for instance in failed.filter(failure_streak__lte=limit, gave_up=False).order_by("id"):
            due = instance.state_changed_at + timedelta(seconds=self.settings.backoff_s(instance.failure_streak))
            if due > now:
                continue
            try:
                upkeep.restart_failed_instance(ACTOR, instance)
            except Conflict:  # an agent's report or a person moved it meanwhile: look again next pass
                continue
            report.restarted += 1

    def place(self, report: PassReport) -> None:
        """Step 3: pending instances onto nodes that fit."""
        waiting = 0
        for group, result in upkeep.place_pending_instances(ACTOR):
            report.placed += len(result.replicas) if isinstance(result, Placement) else len(result.placed)
            if not isinstance(result, Placement):
                waiting += group.instances.filter(state=InstanceState.PENDING, node__isnull=True).count()
        report.unplaceable = waiting  # what still waits, not a sum over the reruns of one run

    def dispatch(self, report: PassReport) -> None:
        """Step 4: StopInstance to stopping instances, StartInstance to placed pending ones, when due."""
        now = self.clock()

        def due(task: str) -> Q:
            resend = timedelta(seconds=self.settings.resend_s(task))
            return Q(dispatched_at__isnull=True) | Q(dispatched_at__lte=now - resend)

        reachable = Instance.objects.select_related("pipeline__model", "group", "node").filter(
            node__isnull=False, node__state=Node.State.ONLINE
        )
        try:
            stopping = reachable.filter(due(TASK_STOP_INSTANCE), state=InstanceState.STOPPING)
            for instance in stopping.order_by("id"):
                report.stopped += self._dispatch(instance, TASK_STOP_INSTANCE, now)
            running = reachable.filter(
                due(TASK_START_INSTANCE),
                state=InstanceState.PENDING,
                pipeline__state=Pipeline.State.RUNNING,
                dispatches__lt=self.settings.max_dispatches,
            )
            for instance in running.order_by("id"):
                report.started += self._dispatch(instance, TASK_START_INSTANCE, now)
        except DispatchError as exc:
            # The broker is one for all nodes: the rest would fail alike. The next pass tries again.
            report.dispatch_error = str(exc)
            log.warning("reconciler: %s; the next pass sends what is left", exc)

    def send_adapter_sets(self, report: PassReport) -> None:
        """Step 5: each pipeline that has had LoRA adapters, its set to every online node running its instances:
        at once when the set changed since it was last sent there, and again every ``resend_after_s``.

        Sent again and again rather than until each worker reports the generation it applied: the task is
        idempotent (an agent that has the set does nothing), so a node that was down, or an agent that lost
        the task, or failed a download, gets it on the next round without the workers reporting anything.
        Kept in this process's memory: a restarted reconciler sends every set once more, which is harmless."""
        now = self.clock()
        resend = timedelta(seconds=self.settings.resend_s(TASK_SET_ADAPTERS))
        on_nodes = (
            Instance.objects.filter(
                pipeline__adapter_generation__gt=0,
                pipeline__state=Pipeline.State.RUNNING,
                state__in=[InstanceState.DOWNLOADING, InstanceState.STARTING, InstanceState.READY],
                node__state=Node.State.ONLINE,
            )
            .values_list("pipeline_id", "node__name")
            .distinct()
        )
        wanted = set(on_nodes)
        if not wanted:
            self._adapter_sets_sent.clear()
            return
        pipelines = {p.pk: p for p in Pipeline.objects.filter(pk__in={pk for pk, _ in wanted})}
        try:
            for pipeline_id, node in sorted(wanted):
                pipeline = pipelines[pipeline_id]
                sent = self._adapter_sets_sent.get((pipeline_id, node))
                if sent is not None and sent[0] == pipeline.adapter_generation and now - sent[1] < resend:
                    continue
                message = adapters_message(pipeline, node)
                self.dispatcher.set_adapters(node, message, expires_s=resend.total_seconds())
                self._adapter_sets_sent[(pipeline_id, node)] = (pipeline.adapter_generation, now)
                report.adapter_sets += 1
        except DispatchError as exc:
            report.dispatch_error = str(exc)
            log.warning("reconciler: %s; the next pass sends the adapter sets left", exc)
        for gone in set(self._adapter_sets_sent) - wanted:
            del self._adapter_sets_sent[gone]

    def _dispatch(self, instance: Instance, task: str, now: datetime) -> bool:
        node = instance.node
        assert node is not None  # the dispatch query takes placed instances only
        expires_s = self.settings.resend_s(task)
        send: Callable[[], None]
        spec: dict[str, Any] | None = None
        if task == TASK_STOP_INSTANCE:
            stop = stop_message(instance, grace_s=self.settings.stop_grace_s)
            send = partial(self.dispatcher.stop_instance, node.name, stop, expires_s=expires_s)
        else:
            try:
                start = start_message(instance)
            except HostTierRefused as exc:
                # Its model's defaults changed since deploy: a start would fail on the node the same way.
                upkeep.refuse_start(ACTOR, instance, f"cannot be started as it stands: {exc}")
                return False
            send = partial(self.dispatcher.start_instance, node.name, start, expires_s=expires_s)
            spec = msgspec.to_builtins(start.spec)  # the instance page shows the settings as they were sent
        return upkeep.dispatch_instance(ACTOR, instance, task, send, now, spec=spec)

    @property
    def _lease_ttl(self) -> timedelta:
        return timedelta(seconds=self.settings.lease_s)

    def _renew(self) -> None:
        if self._holder and not Lease.extend(LEASE_NAME, self._holder, self.clock(), self._lease_ttl):
            raise LeaseLost
