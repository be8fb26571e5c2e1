"""One instance's page: its placement decision and why, its timeline, its replica's restart history, its
engine settings, its load, and its log followed live with a filter.

The state, placement, timeline and restarts are one partial (``partials/instance_detail.html``), which the
instance's socket (controlplane/live/consumers.py ``InstanceConsumer``) renders again when the instance
changes; the load is the bridge's, forwarded to the page as the pipeline page gets it. Every role may read it.
"""

import json
import shlex
from typing import Any

import msgspec
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET

from controlplane.dashboard import queries
from controlplane.dashboard.views import render_page
from controlplane.deployments.instance_events import restart_history
from controlplane.deployments.kv_tiers import HostTierRefused
from controlplane.deployments.models import Instance, InstanceEvent
from controlplane.deployments.worker_specs import start_message

#: Timeline events shown (the table keeps up to instance_events.KEEP_EVENTS).
SHOWN_EVENTS = 200


def instance_for_page() -> Any:
    """The query of the instances the page shows, with what their name and row need."""
    return queries.instances_with_places().select_related("pipeline__model")


@login_required
@require_GET
def instance_page(request: HttpRequest, pk: int) -> HttpResponse:
    """One instance (404 for an unknown one); read-only: its controls stay on the pipeline page."""
    instance = get_object_or_404(instance_for_page(), pk=pk)
    context = detail_context(instance) | {"settings": engine_settings(instance)}
    return render_page(request, "dashboard/instance.html", context)


def detail_context(instance: Instance) -> dict[str, Any]:
    """What ``partials/instance_detail.html`` needs: the instance, its placement record, timeline (newest
    first) and its replica's restarts."""
    events = list(instance.events.order_by("-at", "-id")[:SHOWN_EVENTS])
    placement = instance.placement if isinstance(instance.placement, dict) else {}
    return {
        "instance": instance,
        "placement": placement,
        "cpu_sharing": placement.get("cpu") if isinstance(placement.get("cpu"), dict) else None,
        "events": events,
        "restarts": restart_history(instance),
    }


def engine_settings(instance: Instance) -> dict[str, Any]:
    """The worker spec the instance was last started with (from its timeline's latest start), else the one
    it would be sent now; ``problem`` says why there is none (not placed, or settings that cannot start)."""
    sent = instance.events.filter(kind=InstanceEvent.Kind.DISPATCH, data__has_key="spec").order_by("-at", "-id").first()
    if sent is not None and isinstance(sent.data.get("spec"), dict):
        return _settings(sent.data["spec"], source=sent.at)
    if instance.node is None:
        return {"problem": "not placed on a node yet: its settings are sent with its start"}
    try:
        spec = start_message(instance).spec
    except (ValueError, HostTierRefused) as exc:
        return {"problem": f"it cannot be started as it stands: {exc}"}
    return _settings(msgspec.to_builtins(spec), source=None)


def _settings(spec: dict[str, Any], *, source: Any) -> dict[str, Any]:
    args = spec.get("engine_args") or []
    router = spec.get("router") if isinstance(spec.get("router"), dict) else {}
    return {
        "problem": "",
        "sent_at": source,
        "engine": spec.get("engine", ""),
        "argv": shlex.join(str(arg) for arg in args) if isinstance(args, list) else "",
        "gpus": spec.get("gpu_indexes") or [],
        "labels": spec.get("labels") or {},
        "router": sorted(router.items()),
        "document": json.dumps(spec, indent=2, sort_keys=True),
    }
