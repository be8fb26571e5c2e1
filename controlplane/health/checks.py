"""The control plane's health, one check at a time: its database, its broker (Redis), the reconciler's last
pass and the agents seen.

Each check catches its own failure and says it in words, so that the answer is complete whatever is
down and never a 500; none waits longer than ``BROKER_TIMEOUT_S``. Ages are measured on the database's
clock, the one clock the reconciler and the heartbeats are stamped with.
"""

import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import redis
from django.db import DatabaseError, connection
from django.db.models import DurationField, ExpressionWrapper, F, Min
from django.db.models.functions import Now
from kombu.utils.url import maybe_sanitize_url
from redis.backoff import NoBackoff
from redis.retry import Retry

from controlplane.celery_app import broker_url, reconcile_interval_s
from controlplane.deployments.reconciler import LEASE_NAME
from controlplane.fleet.models import Node
from controlplane.health.models import ReconcilerPass
from runtime.errors import ConfigError

# The longest a health check waits for Redis: a load balancer's probe must get its answer in time.
BROKER_TIMEOUT_S = 0.5
# Passes missed before the reconciler counts as late, and the slack on top for one slow pass (placement,
# etcd asked about silent nodes, tasks sent to a broker that retries once).
LATE_AFTER_PASSES = 3
LATE_MARGIN_S = 10.0


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``ok``, and when not, ``error`` (for people who are logged in: it may name
    hosts)."""

    ok: bool
    error: str = ""


@dataclass(frozen=True)
class BrokerCheck(Check):
    url: str = ""  # the broker's URL with its password replaced by ``**``


@dataclass(frozen=True)
class ReconcilerCheck(Check):
    last_pass_at: str | None = None  # ISO 8601, when the last pass finished; None: no pass ever
    age_s: float | None = None  # seconds since then, by the database's clock
    late: bool = True
    late_after_s: float = 0.0
    duration_s: float | None = None  # the last pass's
    summary: str = ""  # what the last pass did


@dataclass(frozen=True)
class AgentsCheck(Check):
    online: int = 0
    offline: int = 0
    last_heartbeat_age_s: float | None = None  # the freshest heartbeat of any node; None: none yet


@dataclass(frozen=True)
class Health:
    database: Check
    broker: BrokerCheck
    reconciler: ReconcilerCheck
    agents: AgentsCheck

    @property
    def ok(self) -> bool:
        """The control plane can do its work: database and broker answer and the reconciler runs. Agents
        are reported but do not count: no node, or offline ones, is the fleet's state, not the control
        plane's fault."""
        return self.database.ok and self.broker.ok and self.reconciler.ok

    def as_dict(self, *, detail: bool) -> dict[str, Any]:
        """The answer of ``/api/v1/health/``; without ``detail`` only states, ages and counts (no error
        text, URL or summary, which may name hosts)."""
        checks: dict[str, dict[str, Any]] = {}
        for name in ("database", "broker", "reconciler", "agents"):
            fields = asdict(getattr(self, name))
            if not detail:
                for private in ("error", "url", "summary"):
                    fields.pop(private, None)
            checks[name] = fields
        return {"status": "ok" if self.ok else "down", **checks}


def late_after_s(interval_s: float) -> float:
    """Seconds without a finished pass after which the reconciler is late."""
    return LATE_AFTER_PASSES * interval_s + LATE_MARGIN_S


def check_health() -> Health:
    """Every check, each on its own (a database that is down fails the three that read it)."""
    return Health(
        database=check_database(), broker=check_broker(), reconciler=check_reconciler(), agents=check_agents()
    )


def check_database() -> Check:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        return Check(ok=False, error=f"the database does not answer: {exc}")
    return Check(ok=True)


def check_broker(url: str | None = None, timeout_s: float = BROKER_TIMEOUT_S) -> BrokerCheck:
    """PING the broker (``FLOTILLA_BROKER_URL``) once, waiting at most ``timeout_s`` to connect and as long
    for the answer."""
    try:
        url = url or broker_url()
    except ConfigError as exc:
        return BrokerCheck(ok=False, error=str(exc))
    shown = str(maybe_sanitize_url(url))
    if url.startswith("memory://"):
        return BrokerCheck(ok=True, url=shown)  # Celery's in-process broker (tests): nothing to ask
    client_url = "unix://" + url.removeprefix("redis+socket://") if url.startswith("redis+socket://") else url
    started = time.monotonic()
    try:
        # No retries: redis-py's default would try three more times with backoff, far past the timeout.
        client = redis.Redis.from_url(
            client_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError) as exc:
        waited = time.monotonic() - started
        return BrokerCheck(
            ok=False,
            url=shown,
            error=f"Redis at {shown} did not answer a PING ({type(exc).__name__} after {waited:.2f} s: {exc})",
        )
    return BrokerCheck(ok=True, url=shown)


def check_reconciler(interval_s: float | None = None) -> ReconcilerCheck:
    """Whether a pass finished within ``late_after_s`` of the interval (``FLOTILLA_RECONCILE_S``)."""
    try:
        interval = interval_s if interval_s is not None else reconcile_interval_s()
    except ConfigError as exc:
        return ReconcilerCheck(ok=False, error=str(exc))
    limit = late_after_s(interval)
    try:
        last = (
            ReconcilerPass.objects.filter(name=LEASE_NAME)
            .annotate(age=ExpressionWrapper(Now() - F("finished_at"), output_field=DurationField()))
            .first()
        )
    except DatabaseError as exc:
        return ReconcilerCheck(ok=False, late_after_s=limit, error=f"the reconciler's last pass cannot be read: {exc}")
    if last is None:
        return ReconcilerCheck(
            ok=False,
            late_after_s=limit,
            error="the reconciler has never finished a pass: is its Celery worker (with beat) running?",
        )
    age_s = max(as_seconds(last.age), 0.0)
    late = age_s > limit
    return ReconcilerCheck(
        ok=not late,
        error=f"the reconciler's last pass finished {age_s:.0f} s ago (late after {limit:g} s)" if late else "",
        last_pass_at=last.finished_at.isoformat(),
        age_s=round(age_s, 3),
        late=late,
        late_after_s=limit,
        duration_s=last.duration_s,
        summary=last.summary,
    )


def check_agents() -> AgentsCheck:
    """Nodes online and offline, and the age of the freshest heartbeat."""
    try:
        online = Node.objects.filter(state=Node.State.ONLINE).count()
        offline = Node.objects.filter(state=Node.State.OFFLINE).count()
        freshest = Node.objects.filter(last_heartbeat_at__isnull=False).aggregate(
            age=Min(ExpressionWrapper(Now() - F("last_heartbeat_at"), output_field=DurationField()))
        )["age"]
    except DatabaseError as exc:
        return AgentsCheck(ok=False, error=f"the nodes cannot be read: {exc}")
    age_s = None if freshest is None else round(max(as_seconds(freshest), 0.0), 3)
    return AgentsCheck(ok=True, online=online, offline=offline, last_heartbeat_age_s=age_s)


def as_seconds(age: timedelta | float | int) -> float:
    """A database's duration in seconds."""
    # Some backends hand a duration aggregate back as microseconds rather than a timedelta.
    return age.total_seconds() if isinstance(age, timedelta) else float(age) / 1_000_000
