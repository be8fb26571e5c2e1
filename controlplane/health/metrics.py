"""``GET /metrics``: the control plane in Prometheus' text format, answered by ``MetricsMiddleware``.

* ``flotilla_controlplane_request_duration_seconds{method, view, status}``: the time Django took for each
  request (histogram), labelled with the URL pattern's name (never the path: ids would make the label set
  grow without bound), the method and the status class (``2xx``…).
* ``flotilla_controlplane_reconcile_duration_seconds``: every reconciler pass so far (histogram),
  ``flotilla_controlplane_reconcile_lag_seconds``: seconds since the last pass finished (+Inf before the
  first), ``flotilla_controlplane_reconcile_late``: 1 when that is past the health check's limit.
* ``flotilla_controlplane_instances{state}`` and ``flotilla_controlplane_nodes{state}``: every state, 0
  included, so that a state that empties reads 0 rather than vanishing.

The reconciler runs in the Celery worker, not in the process that answers, so its metrics and the fleet's
are read from the database at each scrape, not kept in memory. The request histogram is the answering
process's own: under ``uvicorn --workers N`` each scrape reads one worker's.

Like the gateway's ``/metrics`` it needs no token: it says counts and durations, no names of hosts,
models or people.
"""

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.db import DatabaseError
from django.db.models import Count, DurationField, ExpressionWrapper, F
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from controlplane.celery_app import reconcile_interval_s
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance
from controlplane.deployments.reconciler import LEASE_NAME
from controlplane.fleet.models import Node
from controlplane.health.checks import as_seconds, late_after_s
from controlplane.health.models import PASS_BUCKETS_S, ReconcilerPass
from runtime.errors import ConfigError

PREFIX = "flotilla_controlplane"
METRICS_PATH = "/metrics"
_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class FleetCollector(Collector):
    """The reconciler's passes and the fleet's states, read from the database at each scrape."""

    def describe(self) -> Iterator[Any]:
        """The metrics' names, without a query: registering a collector asks for them, and the middleware
        registers it when Django loads it, which may be inside an event loop (the ASGI application's
        import), where a query is refused."""
        yield HistogramMetricFamily(f"{PREFIX}_reconcile_duration_seconds", "")
        for name in ("reconcile_lag_seconds", "reconcile_late", "instances", "nodes", "database_up"):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", "")

    def collect(self) -> Iterator[Any]:
        try:
            yield from self._reconciler()
            yield from self._states("instances", "Instances by state.", Instance, InstanceState.values)
            yield from self._states("nodes", "Nodes by state.", Node, Node.State.values)
        except DatabaseError:
            # Prometheus marks a failed scrape itself; the health check says why.
            up = GaugeMetricFamily(f"{PREFIX}_database_up", "1 when the database answered this scrape.")
            up.add_metric([], 0)
            yield up

    def _reconciler(self) -> Iterator[Any]:
        last = (
            ReconcilerPass.objects.filter(name=LEASE_NAME)
            .annotate(age=ExpressionWrapper(Now() - F("finished_at"), output_field=DurationField()))
            .first()
        )
        histogram = HistogramMetricFamily(
            f"{PREFIX}_reconcile_duration_seconds", "Reconciler passes by how long they took."
        )
        lag = GaugeMetricFamily(
            f"{PREFIX}_reconcile_lag_seconds", "Seconds since the reconciler's last pass finished (+Inf: never)."
        )
        late = GaugeMetricFamily(
            f"{PREFIX}_reconcile_late", "1 when no pass finished for 3 x FLOTILLA_RECONCILE_S + 10 s (or ever)."
        )
        if last is None:
            histogram.add_metric([], [(_bound(b), 0.0) for b in (*PASS_BUCKETS_S, math.inf)], 0.0)
            lag_s = math.inf
        else:
            cumulative, buckets = 0, []
            for bound, count in zip((*PASS_BUCKETS_S, math.inf), last.histogram(), strict=True):
                cumulative += count
                buckets.append((_bound(bound), float(cumulative)))
            histogram.add_metric([], buckets, last.duration_sum_s)
            lag_s = max(as_seconds(last.age), 0.0)
        lag.add_metric([], lag_s)
        try:
            limit = late_after_s(reconcile_interval_s())
        except ConfigError:
            limit = 0.0
        late.add_metric([], 1.0 if lag_s > limit else 0.0)
        yield from (histogram, lag, late)

    def _states(self, name: str, documentation: str, model: Any, states: list[str]) -> Iterator[Any]:
        counts = dict(model.objects.order_by().values_list("state").annotate(n=Count("id")))
        family = GaugeMetricFamily(f"{PREFIX}_{name}", documentation, labels=["state"])
        for state in states:
            family.add_metric([state], float(counts.get(state, 0)))
        yield family


class MetricsMiddleware:
    """Times every request Django handles, and answers ``GET /metrics`` (first in ``MIDDLEWARE``, so the
    time includes every other middleware). Each process has its own registry, owned by this middleware."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response
        self.registry = CollectorRegistry(auto_describe=True)
        self.request_duration = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Time the control plane took for a request, by method, URL pattern name and status class.",
            ["method", "view", "status"],
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(FleetCollector())

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if request.path == METRICS_PATH:
            if request.method not in ("GET", "HEAD"):
                return HttpResponse(status=405, headers={"Allow": "GET, HEAD"})
            return HttpResponse(generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)
        started = time.perf_counter()
        response = self.get_response(request)
        method = request.method if request.method in _METHODS else "other"
        self.request_duration.labels(
            method=method, view=_view_name(request), status=f"{response.status_code // 100}xx"
        ).observe(time.perf_counter() - started)
        return response


def _view_name(request: HttpRequest) -> str:
    """The URL pattern's name (``node-detail``, ``dashboard:overview``), ``static`` for static files
    (answered before URLs are resolved), or ``unmatched`` for a URL that names no view."""
    match = getattr(request, "resolver_match", None)
    if match is not None:
        return str(match.view_name or match.route or "unnamed")
    if request.path.startswith("/static/"):
        return "static"
    return "unmatched"


def _bound(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)
