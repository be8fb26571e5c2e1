"""What an instance's page shows, as template context: its state, placement record, timeline and restarts
(``partials/instance_detail.html``, which the page includes and its socket pushes), and its engine settings."""

import json
import shlex
from typing import Any

import msgspec
from django.db.models import QuerySet

from controlplane.dashboard import queries
from controlplane.deployments.instance_events import restart_history
from controlplane.deployments.kv_tiers import HostTierRefused
from controlplane.deployments.models import Instance, InstanceEvent
from controlplane.deployments.worker_specs import start_message

#: Timeline events shown (the table keeps up to instance_events.KEEP_EVENTS).
SHOWN_EVENTS = 200


def instance_for_page() -> QuerySet[Instance]:
    """The instances as the page shows them, with what their name, row and settings need."""
    return queries.instances_with_places().select_related("pipeline__model")


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
