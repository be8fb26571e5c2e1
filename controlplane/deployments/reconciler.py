"""The reconciler: one pass that moves the fleet towards the desired state, run over and over.

A pass, in order (each step is an action of its own: audited, idempotent, safe beside a second pass):

1. Nodes whose last heartbeat is older than ``node_timeout_s`` go offline; on every offline node, what
   ran or was about to start fails ("node X stopped heartbeating at T") and what was stopping is stopped.
   The workers of those instances may still run (a dead agent, a live node): they are fenced in etcd
   (runtime/fencing.py), so they deregister and exit instead of serving beside their replacements.
2. Failed instances of running pipelines whose backoff has passed go back to pending, unplaced
   (restarts + 1), to be placed wherever they fit now. The backoff grows with the instance's failure
   streak: 0 s after a node loss alone, then 1, 2, 4 … up to ``backoff_max_s``. Past ``max_restarts``
   failures in a row an instance stays failed: "gave up after N restarts: <last reason>".
3. Pending instances are placed (``place_pending_instances``); those that fit nowhere keep their reason.
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
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.db.models import Q
from django.utils import timezone

from controlplane.audit.records import Actor
from controlplane.deployments.actions import place_pending_instances
from controlplane.deployments.dispatch import Dispatcher, DispatchError
from controlplane.deployments.models import Pipeline
from controlplane.deployments.placement import Placement
from controlplane.deployments.worker_specs import start_message, stop_message
from controlplane.errors import Conflict
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Instance, InstanceState, Lease, Node
from runtime.config import env_float, env_int, env_str
from runtime.errors import FlotillaError
from runtime.fencing import put_fences
from runtime.fleet_tasks import TASK_START_INSTANCE, TASK_STOP_INSTANCE

log = logging.getLogger(__name__)

LEASE_NAME = "reconciler"
ACTOR = Actor.system("reconciler")
_GIVEN_UP = "gave up after "


@dataclass(frozen=True, kw_only=True)
class ReconcilerSettings:
    """The reconciler's timings, each from a ``FLOTILLA_*`` variable (``from_env``)."""

    interval_s: float = 2.0  # FLOTILLA_RECONCILE_S: between passes
    node_timeout_s: float = 15.0  # FLOTILLA_NODE_TIMEOUT_S: three missed 5 s heartbeats
    resend_after_s: float = 30.0  # FLOTILLA_DISPATCH_RESEND_S: a task unanswered this long is sent again
    backoff_max_s: float = 60.0  # FLOTILLA_RESTART_BACKOFF_MAX_S
    max_restarts: int = 10  # FLOTILLA_MAX_RESTARTS: failures in a row restarted before giving up
    stop_grace_s: float = 30.0  # FLOTILLA_STOP_GRACE_S: a stopping worker's time to drain before SIGKILL
    lease_s: float = 10.0  # a pass's lease, renewed at each step; a crashed pass's frees itself after it
    # ETCD_ENDPOINTS: where the workers are registered, to fence those of offline nodes; none: no fencing
    etcd_endpoints: tuple[str, ...] = ()

    @classmethod
    def from_env(cls) -> "ReconcilerSettings":
        """The settings the environment gives. Raises ConfigError naming a malformed variable."""
        return cls(
            interval_s=env_float("FLOTILLA_RECONCILE_S", cls.interval_s, minimum=0.1),
            node_timeout_s=env_float("FLOTILLA_NODE_TIMEOUT_S", cls.node_timeout_s, minimum=1.0),
            resend_after_s=env_float("FLOTILLA_DISPATCH_RESEND_S", cls.resend_after_s, minimum=1.0),
            backoff_max_s=env_float("FLOTILLA_RESTART_BACKOFF_MAX_S", cls.backoff_max_s, minimum=0.0),
            max_restarts=env_int("FLOTILLA_MAX_RESTARTS", cls.max_restarts, minimum=0),
            stop_grace_s=env_float("FLOTILLA_STOP_GRACE_S", cls.stop_grace_s, minimum=0.0),
            etcd_endpoints=tuple(part.strip() for part in (env_str("ETCD_ENDPOINTS") or "").split(",") if part.strip()),
        )

    def backoff_s(self, failure_streak: int) -> float:
        """Seconds a failed instance waits before it is started again."""
        if failure_streak <= 0:
            return 0.0
        return min(2.0 ** min(failure_streak - 1, 32), self.backoff_max_s)


@dataclass
class PassReport:
    """What one pass (or one run of passes) did."""

    nodes_offline: list[str] = field(default_factory=list)
    instances_lost: int = 0
    fenced: int = 0
    restarted: int = 0
    gave_up: int = 0
    placed: int = 0
    unplaceable: int = 0
    started: int = 0
    stopped: int = 0
    dispatch_error: str = ""

    @property
    def changed(self) -> bool:
        counts = (self.instances_lost, self.restarted, self.gave_up, self.placed, self.started, self.stopped)
        return bool(self.nodes_offline or self.dispatch_error or any(counts))

    def summary(self) -> str:
        """One line for a log: only what happened."""
        parts = [f"nodes offline: {', '.join(self.nodes_offline)}"] if self.nodes_offline else []
        counts = {
            "lost with their node": self.instances_lost,
            "workers fenced": self.fenced,
            "restarted": self.restarted,
            "given up": self.gave_up,
            "placed": self.placed,
            "unplaceable": self.unplaceable,
            "started": self.started,
            "stopped": self.stopped,
        }
        parts += [f"{name}: {count}" for name, count in counts.items() if count]
        if self.dispatch_error:
            parts.append(f"dispatch failed: {self.dispatch_error}")
        return "; ".join(parts) or "nothing to do"

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


class LeaseLost(Exception):
    """The pass was slower than its lease and another pass took it over."""


class Reconciler:
    """Runs passes with ``dispatcher`` carrying the tasks; ``clock`` is the time (tests move it)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        settings: ReconcilerSettings | None = None,
        *,
        clock: Callable[[], datetime] = timezone.now,
    ) -> None:
        self.dispatcher = dispatcher
        self.settings = settings or ReconcilerSettings.from_env()
        self.clock = clock
        self._holder = ""

    def run_once(self) -> PassReport | None:
        """One pass under the lease, and more while others asked for one meanwhile.

        Returns None (and asks the holder for another pass) when another pass is running.
        """
        holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        if not Lease.acquire(LEASE_NAME, holder, self.clock(), self._lease_ttl):
            log.debug("another reconciler pass is running; it will run once more")
            return None
        self._holder = holder
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
        return report

    def reconcile(self, report: PassReport | None = None) -> PassReport:
        """The four steps, without the lease (``run_once`` takes it). Raises LeaseLost when the lease of
        the pass was taken over."""
        report = report if report is not None else PassReport()
        self._renew()
        self.fail_lost_nodes(report)
        self._renew()
        self.restart_failed(report)
        self._renew()
        self.place(report)
        self._renew()
        self.dispatch(report)
        return report

    def fail_lost_nodes(self, report: PassReport) -> None:
        """Step 1: silent nodes offline, and the instances of offline nodes failed or stopped."""
        silent_since = self.clock() - timedelta(seconds=self.settings.node_timeout_s)
        for node in Node.objects.filter(state=Node.State.ONLINE, last_heartbeat_at__lt=silent_since):
            if fleet_actions.mark_node_offline(ACTOR, node, silent_since):
                report.nodes_offline.append(node.name)
        occupied = Node.objects.filter(
            state=Node.State.OFFLINE,
            instances__state__in=[
                InstanceState.PENDING,
                InstanceState.DOWNLOADING,
                InstanceState.STARTING,
                InstanceState.READY,
                InstanceState.STOPPING,
            ],
        ).distinct()
        for node in occupied:
            lost = fleet_actions.evacuate_offline_node(ACTOR, node)
            report.instances_lost += len(lost)
            report.fenced += self.fence(node, [i.endpoint_instance_id for i in lost if i.endpoint_instance_id])

    def fence(self, node: Node, worker_ids: list[int]) -> int:
        """Fence the workers ``worker_ids`` of offline ``node``; returns how many were fenced.

        Failing to (no etcd configured, or none answering) is logged with its consequence; the pass
        goes on, as the replacements are placed either way.
        """
        if not worker_ids:
            return 0
        ids = ", ".join(f"{worker_id:x}" for worker_id in worker_ids)
        if not self.settings.etcd_endpoints:
            log.warning(
                "cannot fence the workers of offline node %s (%s): ETCD_ENDPOINTS is not set for the control "
                "plane; if they still run, they serve beside their replacements until their agent returns",
                node.name,
                ids,
            )
            return 0
        reason = f"node {node.name} stopped heartbeating; the control plane placed this replica elsewhere"
        try:
            asyncio.run(put_fences(list(self.settings.etcd_endpoints), worker_ids, reason))
        except FlotillaError as exc:
            log.error(
                "%s: the workers of offline node %s (%s) may serve until their agent returns",
                exc,
                node.name,
                ids,
            )
            return 0
        return len(worker_ids)

    def restart_failed(self, report: PassReport) -> None:
        """Step 2: failed instances back to pending once their backoff passed, or given up."""
        now = self.clock()
        limit = self.settings.max_restarts
        failed = Instance.objects.select_related("pipeline", "group").filter(
            state=InstanceState.FAILED, pipeline__state=Pipeline.State.RUNNING
        )
        for instance in failed.filter(failure_streak__gt=limit).exclude(reason__startswith=_GIVEN_UP).order_by("id"):
            report.gave_up += fleet_actions.give_up_instance(ACTOR, instance, limit)
        for instance in failed.filter(failure_streak__lte=limit).order_by("id"):
            due = instance.state_changed_at + timedelta(seconds=self.settings.backoff_s(instance.failure_streak))
            if due > now:
                continue
            try:
                fleet_actions.restart_failed_instance(ACTOR, instance)
            except Conflict:  # an agent's report or a person moved it meanwhile: look again next pass
                continue
            report.restarted += 1

    def place(self, report: PassReport) -> None:
        """Step 3: pending instances onto nodes that fit."""
        waiting = 0
        for group, result in place_pending_instances(ACTOR):
            report.placed += len(result.replicas) if isinstance(result, Placement) else len(result.placed)
            if not isinstance(result, Placement):
                waiting += group.instances.filter(state=InstanceState.PENDING, node__isnull=True).count()
        report.unplaceable = waiting  # what still waits, not a sum over the reruns of one run

    def dispatch(self, report: PassReport) -> None:
        """Step 4: StopInstance to stopping instances, StartInstance to placed pending ones, when due."""
        now = self.clock()
        resend = self.settings.resend_after_s
        due = Q(dispatched_at__isnull=True) | Q(dispatched_at__lte=now - timedelta(seconds=resend))
        reachable = Instance.objects.select_related("pipeline__model", "group", "node").filter(
            due, node__isnull=False, node__state=Node.State.ONLINE
        )
        try:
            for instance in reachable.filter(state=InstanceState.STOPPING).order_by("id"):
                report.stopped += self._dispatch(instance, TASK_STOP_INSTANCE, now)
            running = reachable.filter(state=InstanceState.PENDING, pipeline__state=Pipeline.State.RUNNING)
            for instance in running.order_by("id"):
                report.started += self._dispatch(instance, TASK_START_INSTANCE, now)
        except DispatchError as exc:
            # The broker is one for all nodes: the rest would fail alike. The next pass tries again.
            report.dispatch_error = str(exc)
            log.warning("reconciler: %s; the next pass sends what is left", exc)

    def _dispatch(self, instance: Instance, task: str, now: datetime) -> bool:
        node = instance.node
        assert node is not None  # the dispatch query takes placed instances only
        expires_s = self.settings.resend_after_s
        send: Callable[[], None]
        if task == TASK_STOP_INSTANCE:
            stop = stop_message(instance, grace_s=self.settings.stop_grace_s)
            send = partial(self.dispatcher.stop_instance, node.name, stop, expires_s=expires_s)
        else:
            start = start_message(instance)
            send = partial(self.dispatcher.start_instance, node.name, start, expires_s=expires_s)
        return fleet_actions.dispatch_instance(ACTOR, instance, task, send, now)

    @property
    def _lease_ttl(self) -> timedelta:
        return timedelta(seconds=self.settings.lease_s)

    def _renew(self) -> None:
        if self._holder and not Lease.extend(LEASE_NAME, self._holder, self.clock(), self._lease_ttl):
            raise LeaseLost
