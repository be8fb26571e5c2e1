"""The bridge: workers' load metrics and KV events on NATS, pushed to the pipeline pages' sockets.

Workers publish a ``WorkerLoad`` per dp rank once a second on ``flotilla.<ns>.<comp>.load_metrics``
(JSON) and their KV events on ``flotilla.<ns>.<comp>.kv_events`` (msgpack ``KvEventBatch``), named by
their endpoint instance id (runtime/kv/load_metrics.py, runtime/kv/publisher.py). The bridge maps that id to
the instance's row (``InstanceDirectory``), sums the ranks and counts the blocks stored and removed per
second (``InstanceFigures``), renders the load partial once and sends it to ``pipeline.<pk>`` through
the channel layer, at most once per ``interval`` per instance: the first report after a quiet interval
goes at once, later ones wait for the interval's end and go together. The instances of a disaggregated
pipeline's prefill and decode groups also have their phases summed per group (controlplane/live/group_phases.py),
pushed as the group's phases partial on the same schedule, per group. And every instance's latest load
is summed per pipeline (controlplane/live/fleet_load.py) for the overview's KV figures, pushed to
``fleet.load`` at most once per ``interval``.

Failures are logged and survived: an undecodable message, an unknown instance (a worker that is not the
control plane's), a Redis that does not answer (at most one warning per ``FAILURE_REPORT_S``). A
subscription task that fails is logged and restarted by the supervisor. NATS itself is the exception:
lost for longer than ``nats_timeout`` it ends the bridge (``BridgeError``), for its supervisor to restart.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec
from channels.db import database_sync_to_async
from channels.layers import BaseChannelLayer
from django.core.exceptions import ObjectDoesNotExist
from django.db import DatabaseError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from controlplane.dashboard.partials import render_fleet_load, render_group_phases, render_instance_load
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance, WorkerGroup
from controlplane.live import fleet_load
from controlplane.live.group_phases import PhaseCounts, summarise
from controlplane.live.groups import LOAD, html, pipeline_group
from controlplane.live.publisher import describe, layer_address
from runtime.errors import FlotillaError
from runtime.kv.events import (
    LOWER_TIERS,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    TierLoad,
    WorkerLoad,
)
from runtime.rate_limited_log import RateLimitedLog
from runtime.supervision import Supervisor

log = logging.getLogger(__name__)

LOAD_SUBJECT = "flotilla.*.*.load_metrics"
KV_EVENTS_SUBJECT = "flotilla.*.*.kv_events"
DEFAULT_INTERVAL_S = 1.0
DEFAULT_NATS_TIMEOUT_S = 60.0
FAILURE_REPORT_S = 30.0

_decode_load = msgspec.json.Decoder(WorkerLoad).decode
_decode_kv_batch = msgspec.msgpack.Decoder(KvEventBatch).decode


class BridgeError(FlotillaError):
    """The bridge cannot go on (NATS lost for too long); the message says which server and where."""


#: The groups whose phases are summed on their pipeline's page: those of a disaggregated pipeline.
DISAGGREGATED_ROLES = frozenset({WorkerGroup.Role.PREFILL, WorkerGroup.Role.DECODE})


@dataclass(frozen=True)
class Watched:
    """An instance a pipeline page shows: its row, its pipeline's and its worker group's (None: not known)."""

    instance_id: int
    pipeline_id: int
    group_id: int | None = None
    role: str = WorkerGroup.Role.AGGREGATED


def read_directory() -> dict[int, Watched]:
    """Endpoint instance id -> the instance's row and group, for every instance with a worker that is not stopped.

    Runs the ORM: call it from a thread. Raises DatabaseError.
    """
    rows = (
        Instance.objects.filter(endpoint_instance_id__isnull=False)
        .exclude(state=InstanceState.STOPPED)
        .values_list("endpoint_instance_id", "pk", "pipeline_id", "group_id", "group__role")
    )
    return {endpoint_id: Watched(pk, pipeline, group, role) for endpoint_id, pk, pipeline, group, role in rows}


class InstanceDirectory:
    """Which instance row an endpoint instance id is, read from the database every ``refresh_s``, and on a
    miss at most every ``miss_refresh_s`` (a worker that registered a moment ago, or one that is not the
    control plane's, whose every report would otherwise cost a query)."""

    def __init__(
        self,
        read: Callable[[], Awaitable[dict[int, Watched]]],
        *,
        refresh_s: float = 5.0,
        miss_refresh_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._refresh_s = refresh_s
        self._miss_refresh_s = miss_refresh_s
        self._clock = clock
        self._known: dict[int, Watched] = {}
        self._read_at: float | None = None
        self._reading = asyncio.Lock()
        self._read_failures = RateLimitedLog(log, period_s=FAILURE_REPORT_S, clock=clock)

    async def find(self, endpoint_id: int) -> Watched | None:
        """The row of ``endpoint_id``, or None when the database knows no such running worker."""
        age = None if self._read_at is None else self._clock() - self._read_at
        watched = self._known.get(endpoint_id)
        if age is None or age >= self._refresh_s or (watched is None and age >= self._miss_refresh_s):
            await self._refresh()
            watched = self._known.get(endpoint_id)
        return watched

    def forget(self, endpoint_id: int) -> None:
        self._known.pop(endpoint_id, None)

    def instances(self) -> set[int]:
        """The row ids of the running instances, as last read (no query)."""
        return {watched.instance_id for watched in self._known.values()}

    async def _refresh(self) -> None:
        async with self._reading:
            if self._read_at is not None and self._clock() - self._read_at < self._miss_refresh_s:
                return  # read while we waited for the lock
            try:
                self._known = await self._read()
            except DatabaseError as exc:
                self._read_failures.warning(
                    f"live bridge: cannot read the instances from the database ({exc}); using the last list"
                )
            self._read_at = self._clock()


@dataclass
class InstanceFigures:
    """What one instance reported since its last push: its ranks' latest load and its KV blocks counted."""

    ranks: dict[int, WorkerLoad] = field(default_factory=dict)
    reported_at: float = 0.0  # wall clock, for the charts
    blocks_stored: int = 0
    blocks_removed: int = 0
    counting_since: float | None = None  # monotonic
    # The ranks' generated-token counters summed, and when (monotonic), at the last push: tokens/s.
    generated: tuple[float, int] | None = None
    # Disaggregated serving: (prefills, their seconds, handoffs, their seconds) at the last push.
    phases: tuple[int, float, int, float] | None = None

    def count(self, batch: KvEventBatch, now: float) -> None:
        if self.counting_since is None:
            self.counting_since = now
        if batch.event_id == 0:
            return  # a whole-state answer describes the cache, it is not new work
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks_stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks_removed += len(event.block_hashes)
            elif isinstance(event, AllCleared):
                pass

    def take(self, now: float) -> dict[str, Any]:
        """The load as the partial takes it (``WorkerLoad``'s fields over all ranks, block rates per second,
        ``at``); the block counts start again."""
        loads = list(self.ranks.values())
        load: dict[str, Any] = {"at": self.reported_at, "dp_ranks": len(loads)}
        load["active_requests"] = sum(report.active_requests for report in loads)
        for name in ("running", "waiting", "kv_active_blocks", "kv_total_blocks"):
            values = [getattr(report, name) for report in loads if getattr(report, name) is not None]
            if values:
                load[name] = sum(values)
        if load.get("kv_total_blocks"):
            load["kv_usage"] = load.get("kv_active_blocks", 0) / load["kv_total_blocks"]
        else:
            usages = [report.kv_usage for report in loads if report.kv_usage is not None]
            if usages:
                load["kv_usage"] = sum(usages) / len(usages)
        hit_rates = [report.prefix_hit_rate for report in loads if report.prefix_hit_rate is not None]
        if hit_rates:
            load["prefix_hit_rate"] = sum(hit_rates) / len(hit_rates)
        counters = [report.generated_tokens for report in loads]
        if loads and None not in counters:
            total = sum(counters)  # type: ignore[arg-type]
            if self.generated is not None and now > self.generated[0] and total >= self.generated[1]:
                load["tokens_per_s"] = (total - self.generated[1]) / (now - self.generated[0])
            # A restarted worker's counter starts again at 0: the next push gives a rate again.
            self.generated = (now, total)
        self._phases(loads, load)
        tiers = sum_tiers(loads)
        if tiers:
            load["tiers"] = tiers
        if self.counting_since is not None and now > self.counting_since:
            elapsed = now - self.counting_since
            load["kv_blocks_stored_per_s"] = self.blocks_stored / elapsed
            load["kv_blocks_removed_per_s"] = self.blocks_removed / elapsed
            self.blocks_stored = self.blocks_removed = 0
            self.counting_since = now
        return load

    def _phases(self, loads: list[WorkerLoad], load: dict[str, Any]) -> None:
        """The worker's part in disaggregated serving: prompts computed for decode workers and KV handoffs taken
        (totals), and their mean seconds since the last push (when some came)."""
        report = next((report for report in loads if report.prefills is not None or report.handoffs is not None), None)
        if report is None:
            return
        now = (report.prefills or 0, report.prefill_seconds or 0.0, report.handoffs or 0,
               report.handoff_first_token_seconds or 0.0)  # fmt: skip
        load["prefills"], load["handoffs"] = now[0], now[2]
        before = self.phases
        if before is None or before[0] > now[0] or before[2] > now[2]:
            before = (0, 0.0, 0, 0.0)  # the first report, or a restarted worker whose counters began again
        if now[0] > before[0]:
            load["prefill_ms"] = (now[1] - before[1]) / (now[0] - before[0]) * 1000
        if now[2] > before[2]:
            load["handoff_first_token_ms"] = (now[3] - before[3]) / (now[2] - before[2]) * 1000
        self.phases = now


def sum_tiers(loads: list[WorkerLoad]) -> list[dict[str, Any]]:
    """Each lower KV tier over the ranks, best first: blocks summed (usage = used / total when both are
    known, else the ranks' mean usage) and the ranks' mean hit rate. [] when no rank reports a tier."""
    by_medium: dict[str, list[TierLoad]] = {}
    for report in loads:
        for tier in report.tiers or ():
            by_medium.setdefault(tier.medium, []).append(tier)
    summed = []
    for medium in LOWER_TIERS:
        tiers = by_medium.get(medium)
        if not tiers:
            continue
        figures: dict[str, Any] = {"medium": medium}
        for name in ("total_blocks", "used_blocks"):
            values = [getattr(tier, name) for tier in tiers if getattr(tier, name) is not None]
            if values:
                figures[name] = sum(values)
        if figures.get("total_blocks") and "used_blocks" in figures:
            figures["usage"] = figures["used_blocks"] / figures["total_blocks"]
        elif usages := [tier.usage for tier in tiers if tier.usage is not None]:
            figures["usage"] = sum(usages) / len(usages)
        if hit_rates := [tier.hit_rate for tier in tiers if tier.hit_rate is not None]:
            figures["hit_rate"] = sum(hit_rates) / len(hit_rates)
        summed.append(figures)
    return summed


@dataclass
class _Pushes:
    """An instance's push schedule: when the last one went, and the timer of the next."""

    figures: InstanceFigures = field(default_factory=InstanceFigures)
    watched: Watched | None = None
    pushed_at: float | None = None
    timer: asyncio.TimerHandle | None = None


@dataclass
class _GroupPushes:
    """A prefill or decode group's push schedule: its instances' latest phase counters (by instance row id),
    those of its last push, when that went, and the timer of the next."""

    pipeline_id: int
    counts: dict[int, PhaseCounts] = field(default_factory=dict)
    before: dict[int, PhaseCounts] = field(default_factory=dict)
    pushed_at: float | None = None
    timer: asyncio.TimerHandle | None = None


def render_load(watched: Watched, load: dict[str, Any]) -> str:
    """The instance's load partial. Runs templates and one query: call it from a thread. Raises
    Instance.DoesNotExist."""
    return render_instance_load(watched.instance_id, load)


def render_phases(group_id: int, phases: dict[str, Any]) -> str:
    """The group's phases partial. Runs templates and one query: call it from a thread. Raises
    WorkerGroup.DoesNotExist."""
    return render_group_phases(group_id, phases)


class LiveBridge:
    """Subscribes to the workers' load and KV events on ``nc`` and pushes load partials to ``layer``."""

    def __init__(
        self,
        nc: NATS,
        layer: BaseChannelLayer,
        directory: InstanceDirectory,
        supervisor: Supervisor,
        *,
        interval: float = DEFAULT_INTERVAL_S,
        render: Callable[[Watched, dict[str, Any]], Awaitable[str]] | None = None,
        render_group: Callable[[int, dict[str, Any]], Awaitable[str]] | None = None,
        render_fleet: Callable[[dict[int, dict[str, float]]], Awaitable[str]] | None = None,
    ) -> None:
        self._nc = nc
        self._layer = layer
        self._directory = directory
        self._supervisor = supervisor
        self.interval = interval
        self._render = render or database_sync_to_async(render_load)
        self._render_group = render_group or database_sync_to_async(render_phases)
        self._render_fleet = render_fleet or database_sync_to_async(render_fleet_load)
        # Each instance's latest load (by row id: its pipeline's id and the load), and the overview's schedule.
        self._fleet_loads: dict[int, tuple[int, dict[str, Any]]] = {}
        self._fleet = _Pushes()
        self._instances: dict[int, _Pushes] = {}  # by endpoint instance id
        self._groups: dict[int, _GroupPushes] = {}  # by worker group id
        self._push_tasks: set[asyncio.Task[None]] = set()
        self._layer_failures = RateLimitedLog(log, period_s=FAILURE_REPORT_S, held_level=logging.DEBUG)
        self._bad_messages = RateLimitedLog(log, period_s=FAILURE_REPORT_S)
        #: Counters, for tests and logs.
        self.pushed = 0
        self.pushed_groups = 0
        self.pushed_fleet = 0
        self.unknown = 0

    def start(self) -> None:
        """Own the two subscription tasks (restarted if they fail) from now on."""
        self._supervisor.own(lambda: self._consume(LOAD_SUBJECT, self._on_load), name="load metrics", restart=True)
        self._supervisor.own(
            lambda: self._consume(KV_EVENTS_SUBJECT, self._on_kv_events), name="KV events", restart=True
        )

    def latest_loads(self) -> list[tuple[int, dict[str, Any]]]:
        """Each running instance's latest load pushed, as ``(pipeline id, load)`` (for the metric samples)."""
        running = self._directory.instances()
        return [entry for pk, entry in self._fleet_loads.items() if pk in running]

    async def close(self) -> None:
        """Stop the timers and wait for the pushes under way (the supervisor stops the subscriptions)."""
        for pushes in [*self._instances.values(), *self._groups.values(), self._fleet]:
            if pushes.timer is not None:
                pushes.timer.cancel()
        for task in list(self._push_tasks):
            task.cancel()
        await asyncio.gather(*self._push_tasks, return_exceptions=True)

    async def _consume(self, subject: str, handle: Callable[[Msg], Awaitable[None]]) -> None:
        subscription = await self._nc.subscribe(subject)
        try:
            async for message in subscription.messages:
                await handle(message)
        finally:
            with contextlib.suppress(Exception):  # the connection may be closing already
                await subscription.unsubscribe()

    async def _on_load(self, message: Msg) -> None:
        try:
            report = _decode_load(message.data)
        except msgspec.DecodeError as exc:
            self._report_bad_message(message.subject, exc)
            return
        pushes = await self._pushes_of(report.instance_id)
        if pushes is None:
            return
        pushes.figures.ranks[report.dp_rank] = report
        pushes.figures.reported_at = time.time()
        self._schedule(report.instance_id, pushes, self._push_now)
        self._count_phases(pushes.watched, report)

    async def _on_kv_events(self, message: Msg) -> None:
        try:
            batch = _decode_kv_batch(message.data)
        except msgspec.DecodeError as exc:
            self._report_bad_message(message.subject, exc)
            return
        pushes = await self._pushes_of(batch.instance_id)
        if pushes is not None:
            pushes.figures.count(batch, asyncio.get_running_loop().time())

    async def _pushes_of(self, endpoint_id: int) -> _Pushes | None:
        watched = await self._directory.find(endpoint_id)
        if watched is None:
            self.unknown += 1
            self._drop(endpoint_id)
            return None
        pushes = self._instances.get(endpoint_id)
        if pushes is None:
            pushes = self._instances[endpoint_id] = _Pushes()
        pushes.watched = watched
        return pushes

    def _schedule(self, key: int, pushes: _Pushes | _GroupPushes, push_now: Callable[[int], None]) -> None:
        if pushes.timer is not None:
            return  # a push is coming, and will carry this report
        loop = asyncio.get_running_loop()
        due = loop.time() if pushes.pushed_at is None else max(loop.time(), pushes.pushed_at + self.interval)
        # Even "now" waits for the loop's next turn: the other ranks of the same tick, read from the same
        # socket, join this push.
        pushes.timer = loop.call_at(due, push_now, key)

    def _push_now(self, endpoint_id: int) -> None:
        pushes = self._instances.get(endpoint_id)
        if pushes is None:
            return
        loop = asyncio.get_running_loop()
        pushes.timer = None
        pushes.pushed_at = loop.time()
        self._start(self._push(endpoint_id, pushes.figures.take(loop.time())))

    def _start(self, push: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(push)
        self._push_tasks.add(task)
        task.add_done_callback(self._push_tasks.discard)

    def _count_phases(self, watched: Watched | None, report: WorkerLoad) -> None:
        """Keep the phase counters of a report from an instance of a prefill or decode group, for its group's
        next push (kept as they arrive, so that a group's push never waits for its instances')."""
        if watched is None or watched.group_id is None or watched.role not in DISAGGREGATED_ROLES:
            return
        if report.prefills is None and report.handoffs is None:
            return  # not the rank that counts, or the worker has served no such request yet
        group = self._groups.get(watched.group_id)
        if group is None:
            group = self._groups[watched.group_id] = _GroupPushes(watched.pipeline_id)
        group.counts[watched.instance_id] = PhaseCounts(
            report.prefills or 0,
            report.prefill_seconds or 0.0,
            report.handoffs or 0,
            report.handoff_first_token_seconds or 0.0,
        )
        self._schedule(watched.group_id, group, self._push_group_now)

    def _push_group_now(self, group_id: int) -> None:
        group = self._groups.get(group_id)
        if group is None:
            return
        group.timer = None
        # Stopped instances leave the group's totals (the directory lists the running ones).
        running = self._directory.instances()
        group.counts = {instance: counts for instance, counts in group.counts.items() if instance in running}
        if not group.counts:
            del self._groups[group_id]
            return
        now = asyncio.get_running_loop().time()
        elapsed = None if group.pushed_at is None else now - group.pushed_at
        phases = summarise(group.before, group.counts, elapsed)
        group.before, group.pushed_at = dict(group.counts), now
        self._start(self._push_group(group_id, group.pipeline_id, phases))

    async def _push(self, endpoint_id: int, load: dict[str, Any]) -> None:
        watched = await self._directory.find(endpoint_id)
        if watched is None:
            self._drop(endpoint_id)
            return
        try:
            text = await self._render(watched, load)
        except ObjectDoesNotExist:
            self._directory.forget(endpoint_id)
            self._drop(endpoint_id)
            return
        except Exception:
            log.exception("live bridge: rendering the load of instance %d failed", watched.instance_id)
            return
        try:
            await self._layer.group_send(
                pipeline_group(watched.pipeline_id), dict(html(text, instance=watched.instance_id))
            )
        except Exception as exc:  # Redis's errors, OSError, timeouts: the next second tries again
            self._report_layer_failure(exc)
            return
        self.pushed += 1
        self._fleet_loads[watched.instance_id] = (watched.pipeline_id, load)
        self._schedule(0, self._fleet, self._push_fleet_now)

    def _push_fleet_now(self, _: int) -> None:
        self._fleet.timer = None
        self._fleet.pushed_at = asyncio.get_running_loop().time()
        # Stopped instances leave the figures (the directory lists the running ones).
        running = self._directory.instances()
        self._fleet_loads = {pk: entry for pk, entry in self._fleet_loads.items() if pk in running}
        self._start(self._push_fleet(fleet_load.summarise(self._fleet_loads.values())))

    async def _push_fleet(self, summary: dict[int, dict[str, float]]) -> None:
        try:
            text = await self._render_fleet(summary)
        except Exception:
            log.exception("live bridge: rendering the fleet's KV figures failed")
            return
        try:
            await self._layer.group_send(LOAD, dict(html(text)))
        except Exception as exc:  # as for an instance's load
            self._report_layer_failure(exc)
            return
        self.pushed_fleet += 1

    async def _push_group(self, group_id: int, pipeline_id: int, phases: dict[str, Any]) -> None:
        try:
            text = await self._render_group(group_id, phases)
        except ObjectDoesNotExist:
            self._drop_group(group_id)
            return
        except Exception:
            log.exception("live bridge: rendering the phases of worker group %d failed", group_id)
            return
        try:
            await self._layer.group_send(pipeline_group(pipeline_id), dict(html(text, group=group_id)))
        except Exception as exc:  # as for an instance's load
            self._report_layer_failure(exc)
            return
        self.pushed_groups += 1

    def _drop_group(self, group_id: int) -> None:
        group = self._groups.pop(group_id, None)
        if group is not None and group.timer is not None:
            group.timer.cancel()

    def _drop(self, endpoint_id: int) -> None:
        pushes = self._instances.pop(endpoint_id, None)
        if pushes is not None and pushes.timer is not None:
            pushes.timer.cancel()

    def _report_layer_failure(self, exc: Exception) -> None:
        self._layer_failures.warning(
            f"live bridge: cannot reach the channel layer at {layer_address(self._layer)} ({describe(exc)}); load "
            "figures are dropped until it answers"
        )

    def _report_bad_message(self, subject: str, exc: Exception) -> None:
        self._bad_messages.warning(f"live bridge: a message on {subject} is not what workers publish ({exc}); ignored")


class NatsWatch:
    """How long NATS has been lost: ``on_event`` is connect_nats's callback; ``watch`` raises BridgeError once
    the connection has been down for ``timeout`` seconds."""

    def __init__(self, address: str, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.address = address
        self.timeout = timeout
        self._clock = clock
        self.lost_since: float | None = None

    async def on_event(self, kind: str) -> None:
        if kind == "disconnected" and self.lost_since is None:
            self.lost_since = self._clock()
        elif kind == "reconnected":
            self.lost_since = None

    def check(self) -> None:
        """Raises BridgeError when NATS has been lost for ``timeout`` seconds or more."""
        if self.lost_since is not None and self._clock() - self.lost_since >= self.timeout:
            raise BridgeError(
                f"lost NATS at {self.address} for more than {self.timeout:g} s; start it with `make services` "
                "or point --nats (NATS_SERVER) at a running server"
            )

    async def watch(self, every: float = 1.0) -> None:
        while True:
            self.check()
            await asyncio.sleep(every)
