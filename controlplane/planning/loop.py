"""The planner's loop (``manage.py planner``): every interval, for each running pipeline with planner targets,
observe, decide and act.

One process plans at a time: each turn takes (or renews) the ``planner`` lease (deployments.models.Lease,
as the reconciler's passes do), and a second process finds it taken, says so, and waits for it to expire,
taking over within ``3 × interval`` of the first one's death.

What it reads, and what it does when a source fails (it never stops for one):

* the workers' ``WorkerLoad`` reports on NATS (``flotilla.*.*.load_metrics``, as the live bridge
  subscribes), the latest per (instance, dp rank). NATS unreachable at start or lost later is logged with
  its address (runtime/cluster/nats_connection.py) and retried for ever; meanwhile the reports go stale
  (``LoadBook``) and load mode, with no report, holds.
* the gateway's ``/metrics`` (``FLOTILLA_GATEWAY_URL``): TTFT, ITL, prompt and completion lengths over the
  interval (planner/measure.py). Or, given a Prometheus (``FLOTILLA_PLANNER_PROMETHEUS_URL``), the same
  histograms as it holds them, for every ingress it scrapes (several ingresses behind one Prometheus), read
  with one instant query each turn. Or, given the ingress processes' own metrics URLs
  (``FLOTILLA_PLANNER_INGRESS_METRICS``: several processes sharing one port, each with its ``--metrics-port``),
  each one's ``/metrics``, each a source of its own. Unreadable, or answering what is not text exposition of
  histograms the planner can read, any of them is logged with its URL (at most every 30 s) and the pipelines
  are planned in load mode on the workers' reports; the predictor is fed its own prediction meanwhile, so it
  is not taught a false zero. A reading from some of several ingresses is not used: it would under-count.
* the database: a turn that fails on it is logged and the next one tries again.

Each pipeline's ``Planner`` (its predictor history and cooldowns) lives in this process; a restart starts
them fresh (docs/planner.md says why that is safe).
"""

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence

import httpx
import msgspec
from asgiref.sync import sync_to_async
from django.db import DatabaseError
from django.utils import timezone
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from controlplane.database import db_now
from controlplane.deployments.instance_states import LIVE_STATES
from controlplane.deployments.models import Instance, Lease, Pipeline
from controlplane.planning.actions import Seen, apply_decisions
from controlplane.planning.observe import GroupView, LoadBook, PipelineView, observe
from planner.core import Planner
from planner.errors import PlannerError, ProfileError, SettingsError
from planner.measure import (
    IngressSnapshot,
    IngressStats,
    check_ingress_exposition,
    exposition_by_source,
    exposition_from_query,
    ingress_histograms_selector,
    ingress_snapshot,
    ingress_stats,
)
from planner.profile import Profile
from planner.settings import Targets
from planner.targets_json import targets_from_dict
from runtime.kv.events import WorkerLoad
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger("controlplane.planning")

LEASE_NAME = "planner"
LOAD_SUBJECT = "flotilla.*.*.load_metrics"
DEFAULT_INTERVAL_S = 10.0
SCRAPE_TIMEOUT_S = 3.0
MAX_METRICS_BYTES = 8 * 1024 * 1024
FAILURE_REPORT_S = 30.0

_decode_load = msgspec.json.Decoder(WorkerLoad).decode


class ScrapeFailed(Exception):
    """The latency histograms could not be read (the gateway's, the ingresses' or Prometheus's); the message says
    where and why."""


def read_planned_pipelines() -> list[PipelineView]:
    """Running pipelines with planner targets, their groups and their live workers' endpoint ids. Runs the
    ORM: call it from a thread. Raises DatabaseError."""
    views = []
    pipelines = Pipeline.objects.filter(state=Pipeline.State.RUNNING, planner__isnull=False).select_related("model")
    for pipeline in pipelines.prefetch_related("groups"):
        endpoints: dict[int, set[int]] = {}
        live = Instance.objects.filter(pipeline=pipeline, state__in=LIVE_STATES, endpoint_instance_id__isnull=False)
        for group_id, endpoint_id in live.values_list("group_id", "endpoint_instance_id"):
            endpoints.setdefault(group_id, set()).add(endpoint_id)
        groups = tuple(
            GroupView(g.role, g.replicas, g.gpus_per_replica, frozenset(endpoints.get(g.pk, ())))  # type: ignore[arg-type]
            for g in pipeline.groups.all()
        )
        views.append(PipelineView(pipeline.pk, pipeline.name, pipeline.planner, pipeline.model.profile, groups))
    return views


async def scrape_gateway(client: httpx.AsyncClient, url: str) -> str:
    """``<url>/metrics`` as text whose ingress histograms the planner can read. Raises ScrapeFailed naming the
    URL."""
    where = f"{url}/metrics"
    try:
        response = await client.get(where, timeout=SCRAPE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise ScrapeFailed(f"{where} could not be read: {exc or type(exc).__name__}") from exc
    if response.status_code != 200:
        raise ScrapeFailed(f"{where} answered HTTP {response.status_code}")
    if len(response.content) > MAX_METRICS_BYTES:
        raise ScrapeFailed(f"{where} answered more than {MAX_METRICS_BYTES} bytes")
    try:
        check_ingress_exposition(response.text)
    except PlannerError as exc:
        raise ScrapeFailed(f"{where} answered what the planner cannot read: {exc}") from exc
    return response.text


async def scrape_ingresses(client: httpx.AsyncClient, urls: Sequence[str]) -> str:
    """Each ingress process's ``<url>/metrics``, read at once, as one exposition in which each is a source of its
    own (its ``instance`` label is its URL). Raises ScrapeFailed naming every URL that failed: a reading of some
    of them would count part of the traffic as all of it."""
    answers = await asyncio.gather(*(scrape_gateway(client, url) for url in urls), return_exceptions=True)
    failed = [str(answer) for answer in answers if isinstance(answer, BaseException)]
    if failed:
        raise ScrapeFailed("; ".join(failed))
    return exposition_by_source({url: str(text) for url, text in zip(urls, answers, strict=True)})


async def query_prometheus(client: httpx.AsyncClient, url: str) -> str:
    """The ingress histograms ``url``'s Prometheus holds now, as exposition text (planner/measure.py). Raises
    ScrapeFailed naming the URL."""
    where = f"{url}/api/v1/query"
    try:
        response = await client.get(where, params={"query": ingress_histograms_selector()}, timeout=SCRAPE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise ScrapeFailed(f"{where} could not be read: {exc or type(exc).__name__}") from exc
    if len(response.content) > MAX_METRICS_BYTES:
        raise ScrapeFailed(f"{where} answered more than {MAX_METRICS_BYTES} bytes")
    try:
        answer = response.json()
    except ValueError:
        raise ScrapeFailed(f"{where} answered HTTP {response.status_code}, not JSON") from None
    if response.status_code != 200 or not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else None
        raise ScrapeFailed(f"{where} answered HTTP {response.status_code}: {str(error)[:200] or 'no error given'}")
    data = answer.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        raise ScrapeFailed(f"{where} answered something other than an instant vector")
    try:
        text = exposition_from_query(data.get("result"))
        check_ingress_exposition(text)
    except PlannerError as exc:
        raise ScrapeFailed(f"{where}: {exc}") from exc
    return text


@dataclasses.dataclass
class TurnReport:
    """What one turn did, for the command's log and the tests."""

    held_lease: bool = True
    decided: int = 0
    acted: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)


class PlannerLoop:
    """The planner's state in this process and one turn of it (``turn``); ``run`` repeats it."""

    def __init__(
        self,
        *,
        gateway_url: str | None,
        prometheus_url: str | None = None,
        ingress_metrics_urls: Sequence[str] = (),
        interval_s: float = DEFAULT_INTERVAL_S,
        http: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        holder: str | None = None,
    ) -> None:
        self.gateway_url = gateway_url
        self.prometheus_url = prometheus_url  # set: read in place of the gateway's /metrics
        # Set (and no Prometheus): each ingress process's own /metrics, read in place of the gateway's.
        self.ingress_metrics_urls = tuple(ingress_metrics_urls)
        self.interval_s = interval_s
        self.book = LoadBook(stale_s=max(5.0, 2 * interval_s))
        self.planners: dict[int, Planner] = {}
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._http = http or httpx.AsyncClient()
        self._clock = clock
        self._snapshots: dict[str, IngressSnapshot] = {}
        self._gateway_failures = RateLimitedLog(log, period_s=FAILURE_REPORT_S)
        self._bad_reports = RateLimitedLog(log, period_s=FAILURE_REPORT_S)
        self._waiting_said = False

    # The workers' reports, from the NATS subscription.
    async def on_load(self, message: Msg) -> None:
        try:
            report = _decode_load(message.data)
        except msgspec.DecodeError as exc:
            self._bad_reports.warning(f"planner: a message on {message.subject} is not a WorkerLoad ({exc}); ignored")
            return
        self.book.add(report, self._clock())

    async def subscribe(self, nc: NATS) -> None:
        """Take the workers' load reports from ``nc`` from now on (nats-py subscribes again after a loss)."""
        await nc.subscribe(LOAD_SUBJECT, cb=self.on_load)

    async def turn(self) -> TurnReport:
        """One turn: the lease, then each planned pipeline observed, decided and acted on."""
        report = TurnReport()
        ttl = datetime.timedelta(seconds=3 * self.interval_s)
        # The database's clock, as the reconciler's lease: no two processes' clocks are compared.
        if not await sync_to_async(_acquire)(self.holder, ttl):
            report.held_lease = False
            if not self._waiting_said:
                holder = await sync_to_async(_holder)()
                log.info("planner: another planner (%s) holds the lease; waiting to take over", holder)
                self._waiting_said = True
            return report
        if self._waiting_said:
            log.info("planner: took the lease over; planning from now on")
            self._waiting_said = False
        pipelines = await sync_to_async(read_planned_pipelines)()
        metrics = await self._scrape(report)
        now = self._clock()
        reports = self.book.fresh(now)
        for pipeline in pipelines:
            try:
                acted = await self._plan(pipeline, metrics, reports, now, report)
            except PlannerError as exc:  # a snapshot the measure functions refuse: this pipeline waits
                report.problems.append(f"pipeline {pipeline.name}: {exc}")
                log.warning("planner: pipeline %s not planned this turn: %s", pipeline.name, exc)
                continue
            report.acted += acted
        for gone in set(self.planners) - {p.id for p in pipelines}:
            del self.planners[gone]  # planner off or pipeline gone: a later start begins afresh
        return report

    async def release(self) -> None:
        """Let go of the lease (a waiting planner takes it at its next turn)."""
        await sync_to_async(_release)(self.holder)

    @property
    def source(self) -> str:
        """Where the latency histograms come from, as the reasons say it."""
        if self.prometheus_url is not None:
            return "Prometheus"
        return "the ingresses" if self.ingress_metrics_urls else "the gateway"

    async def _scrape(self, report: TurnReport) -> str | None:
        try:
            if self.prometheus_url is not None:
                return await query_prometheus(self._http, self.prometheus_url)
            if self.ingress_metrics_urls:
                return await scrape_ingresses(self._http, self.ingress_metrics_urls)
            if self.gateway_url is None:
                return None
            return await scrape_gateway(self._http, self.gateway_url)
        except ScrapeFailed as exc:
            # The next reading starts a fresh interval: one spanning the outage would average over it.
            self._snapshots.clear()
            report.problems.append(str(exc))
            self._gateway_failures.warning(
                f"planner: {self.source}'s metrics are unreadable ({exc}); planning in load mode on the workers' "
                "reports"
            )
            return None

    async def _plan(
        self, pipeline: PipelineView, metrics: str | None, reports: list[WorkerLoad], now: float, report: TurnReport
    ) -> int:
        try:
            targets = targets_from_dict(pipeline.settings)
        except SettingsError as exc:
            report.problems.append(f"pipeline {pipeline.name}: planner.{exc.field}: {exc}")
            log.warning("planner: pipeline %s's targets are refused (planner.%s: %s)", pipeline.name, exc.field, exc)
            return 0
        profile = self._profile(pipeline, report)
        stats = self._stats(pipeline.name, metrics, targets.default.percentile)
        planner = self.planners.setdefault(pipeline.id, Planner(targets.predictor))
        predicted = planner.demand()
        observation = observe(
            pipeline,
            reports,
            stats,
            interval_s=self.interval_s,
            percentile=targets.default.percentile,
            rate_when_unknown=predicted.request_rate if predicted is not None else 0.0,
            isl_when_unknown=predicted.isl if predicted is not None and predicted.isl > 0 else None,
        )
        # No measurement from the gateway: SLA sizing would size on a guess; load mode judges what workers say.
        decisions = planner.decide(now, targets, observation, profile if stats is not None else None)
        if not targets.enabled:
            return 0  # off: nothing recorded (the predictor still learns, for when it is turned on)
        if stats is None:
            if self.prometheus_url is None and self.gateway_url is None and not self.ingress_metrics_urls:
                why = "no gateway URL set"
            elif metrics is not None:
                why = f"first reading of {self.source}"
            elif self.prometheus_url is not None:
                why = "Prometheus unreadable"
            else:
                why = "ingress metrics unreadable" if self.ingress_metrics_urls else "gateway metrics unreadable"
            decisions = [dataclasses.replace(d, reason=f"{why}: load mode; {d.reason}") for d in decisions]
        rows = await sync_to_async(apply_decisions)(
            pipeline.id, decisions, _seen(targets, stats, planner), timezone.now()
        )
        report.decided += len(rows)
        return sum(1 for row in rows if row.acted)

    def _profile(self, pipeline: PipelineView, report: TurnReport) -> Profile | None:
        if pipeline.profile is None:
            return None
        try:
            return Profile.from_dict(pipeline.profile)
        except ProfileError as exc:
            report.problems.append(f"pipeline {pipeline.name}: the model's profile: {exc}")
            return None

    def _stats(self, name: str, metrics: str | None, percentile: float) -> IngressStats | None:
        """The interval's traffic of served model ``name`` since the last reading (None: no reading now,
        or none before it)."""
        if metrics is None:
            return None
        snapshot = ingress_snapshot(metrics, name, self._clock())
        before = self._snapshots.get(name)
        self._snapshots[name] = snapshot
        if before is None or snapshot.at_s <= before.at_s:
            return None
        return ingress_stats(before, snapshot, percentile)


def _seen(targets: Targets, stats: IngressStats | None, planner: Planner) -> Seen:
    demand = planner.demand()
    return Seen(
        percentile=stats.percentile if stats is not None else targets.default.percentile,
        ttft_s=stats.ttft_s if stats is not None else None,
        itl_s=stats.itl_s if stats is not None else None,
        predicted_rate=demand.request_rate if demand is not None else None,
        predicted_isl=demand.isl if demand is not None and demand.isl else None,
        predicted_osl=demand.osl if demand is not None and demand.osl else None,
    )


def _acquire(holder: str, ttl: datetime.timedelta) -> bool:
    return Lease.acquire(LEASE_NAME, holder, db_now(), ttl)


def _release(holder: str) -> None:
    # A waiter's try sets "run again" on the lease, which the first release only clears: release twice.
    for _ in range(2):
        if Lease.release(LEASE_NAME, holder, db_now()):
            return


def _holder() -> str:
    lease = Lease.objects.filter(name=LEASE_NAME).first()
    return lease.holder if lease is not None and lease.holder else "unknown"


async def run_loop(loop: PlannerLoop, stopping: asyncio.Event) -> None:
    """Turns every ``interval_s`` until ``stopping`` is set; a turn that fails on the database is logged and
    the next one tries again. The lease is let go at the end."""
    try:
        while not stopping.is_set():
            try:
                report = await loop.turn()
            except DatabaseError as exc:
                log.warning("planner: the turn failed on the database (%s); trying again in %g s", exc, loop.interval_s)
            else:
                if report.acted:
                    log.info("planner: %d decision(s), %d acted on", report.decided, report.acted)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), loop.interval_s)
    finally:
        try:
            await loop.release()
        except DatabaseError as exc:
            log.warning("planner: could not let go of the lease (%s); it expires by itself", exc)
