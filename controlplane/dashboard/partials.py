"""The dashboard's partial templates as HTML strings: what pages include and what live pushes send.

Each function renders one top-level element with a stable id (``node-<pk>``, ``pipeline-<pk>``, ...), so
that htmx's websocket extension can swap it in place, out of band, wherever a page shows that record.
Pages include the same templates, so a first render and a live push look the same. The functions take
ids, do their own (few, indexed) queries and need no request: there is no CSRF token or user in them.
The functions that render controls (buttons, forms) take ``can_act``, whether the person who sees the HTML may
act (controlplane/dashboard/access.py): without it the controls are left out of the HTML, not hidden, and the
views refuse such POSTs anyway. Pages pass their ``can_act``, sockets their person's, controls' answers True.

Rows are pushed alone when they change. A row that joins or leaves a list has no element to swap (or
keeps the one it had), so each list also renders as one element with a fixed id (``nodes-table``,
``pipelines-table``, ``downloads-table``, ``models-table``, and ``instances-<pipeline pk>``), pushed when a
row of its kind is created or deleted; it holds the list's empty state too. The fixed ids do not start
with a row's prefix (``nodes-`` is not ``node-``), so a selector of rows (``[id^='node-']``) finds rows only.

The partials may be joined into one websocket message in any order. That is why table rows are
``<div class="tr" role="row">`` rather than ``<tr>``: htmx parses a message as one HTML fragment, and the
HTML parser drops a ``<tr>`` that follows a ``<div>`` and misplaces a table that follows a ``<tr>``. The one
exception is the models table: a whole ``<table>`` inside its ``<div>``, which parses the same anywhere in a
message that holds no stray row; its rows are never pushed alone (a change of a model pushes the table).

A deleted record raises its model's ``DoesNotExist`` (each an ``ObjectDoesNotExist``); the caller decides
what a deletion shows.
"""

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.template.loader import render_to_string
from django.utils.html import format_html

from controlplane.audit.models import AuditEntry
from controlplane.dashboard import planner_panel, queries
from controlplane.dashboard.instance_detail import detail_context, instance_for_page
from controlplane.deployments.models import Instance, Pipeline, WorkerGroup

# The element live audit entries are put at the top of (the overview's recent events).
AUDIT_FEED_ID = "audit-feed"
# The elements that hold a whole list of the fleet (each page that shows the list has one).
NODE_TABLE_ID = "nodes-table"
PIPELINE_TABLE_ID = "pipelines-table"
DOWNLOAD_TABLE_ID = "downloads-table"
MODEL_TABLE_ID = "models-table"


def render_node(node_id: int, *, can_act: bool, offer_forced_drain: bool = False) -> str:
    """``<div id="node-<pk>" class="tr">`` (a table row): state, last heartbeat, CPUs and memory, GPUs
    with memory and utilisation bars, and the cordon and drain buttons (with "Drain anyway" after a drain
    was refused for stranding a pipeline). Raises ``Node.DoesNotExist``."""
    node = queries.nodes_with_gpus().get(pk=node_id)
    context = {"node": node, "offer_forced_drain": offer_forced_drain, "can_act": can_act}
    return render_to_string("dashboard/partials/node.html", context)


def render_node_table(*, can_act: bool) -> str:
    """``<div id="nodes-table">``: every node as ``render_node`` renders it, or how to add the first one
    (two queries)."""
    context = {"nodes": list(queries.nodes_with_gpus()), "can_act": can_act}
    return render_to_string("dashboard/partials/node_table.html", context)


def render_pipeline_table(*, can_act: bool) -> str:
    """``<div id="pipelines-table">``: every pipeline's row as ``render_pipeline_row`` renders it, or how
    to deploy the first one (three queries)."""
    rows = queries.pipeline_rows(queries.pipelines_with_groups())
    return render_to_string("dashboard/partials/pipeline_table.html", {"rows": rows, "can_act": can_act})


def render_download_table() -> str:
    """``<div id="downloads-table">``: every download as ``render_download`` renders it, or why there is
    none yet (one query)."""
    return render_to_string("dashboard/partials/download_table.html", {"downloads": queries.downloads_with_names()})


def render_model_table() -> str:
    """``<div id="models-table">``: the catalog (source, engine, memory per replica, default engine args,
    pipelines using each model), or how to add the first model (one query). Each model's row has the id
    ``model-<pk>`` but is not pushed alone: models are few and change seldom."""
    return render_to_string("dashboard/partials/model_table.html", {"models": queries.models_with_pipeline_counts()})


def render_pipeline_row(pipeline_id: int, *, can_act: bool) -> str:
    """``<div id="pipeline-<pk>" class="tr">``: name, model, engine, state, ready/desired with what holds
    the rest, router mode, and the scale/stop/start controls. Raises ``Pipeline.DoesNotExist``."""
    pipeline = queries.pipelines_with_groups().get(pk=pipeline_id)
    (row,) = queries.pipeline_rows([pipeline])
    return render_to_string("dashboard/partials/pipeline_row.html", {"row": row, "can_act": can_act})


def render_pipeline_instances(pipeline_id: int, *, can_act: bool) -> str:
    """``<div id="instances-<pk>">``: the pipeline's instances (each as ``render_instance`` renders it)
    and a chart panel per instance. Push it when instances are added or removed, since a new instance
    has no element of its own on the page yet. Raises ``Pipeline.DoesNotExist``."""
    pipeline = Pipeline.objects.get(pk=pipeline_id)
    context = instances_context(pipeline) | {"can_act": can_act}
    return render_to_string("dashboard/partials/pipeline_instances.html", context)


def render_instance(instance_id: int, *, can_act: bool) -> str:
    """``<div id="instance-<pk>" class="tr">``: state, node, GPUs, uptime, restarts, reason, download
    progress, and the restart and log buttons. Raises ``Instance.DoesNotExist``."""
    instance = queries.instances_with_places().get(pk=instance_id)
    return render_to_string("dashboard/partials/instance.html", {"instance": instance, "can_act": can_act})


def render_instance_detail(instance_id: int) -> str:
    """``<div id="detail-<pk>">``: an instance page's state, placement decision, restart history and timeline
    (controlplane/dashboard/instance_page.py; no controls). Raises ``Instance.DoesNotExist``."""
    instance = instance_for_page().get(pk=instance_id)
    return render_to_string("dashboard/partials/instance_detail.html", detail_context(instance))


def render_instance_load(instance_id: int, load: Mapping[str, Any]) -> str:
    """``<div id="load-<instance pk>">``: a worker's latest load (a ``WorkerLoad`` as a dict: kv_usage,
    prefix_hit_rate, running, waiting, active_requests, and tokens_per_s and ``at`` (epoch seconds) when
    present; ``tiers``, the lower KV tiers' use and hits, shown only when the worker has some) as text and
    as ``data-*`` attributes, from which static/dashboard/charts.js adds a point to the instance's charts
    after each swap. Missing or non-numeric figures are left out. Raises
    ``Instance.DoesNotExist`` (``instance_id`` is the instance's row id, not its endpoint id)."""
    if not Instance.objects.filter(pk=instance_id).exists():
        raise Instance.DoesNotExist(f"Instance matching query does not exist: {instance_id}")
    return render_to_string(
        "dashboard/partials/instance_load.html", {"instance_id": instance_id, "load": load_figures(load)}
    )


def render_group_phases(group_id: int, phases: Mapping[str, Any] | None) -> str:
    """``<div id="phases-<group pk>">``: a prefill or decode group's phases summed over its instances (the
    bridge's ``summarise``: prompts prefilled and KV handoffs taken, in total, per second and their mean
    milliseconds over the last interval; None: nothing counted yet). Missing or non-numeric figures are left
    out. Raises ``WorkerGroup.DoesNotExist``."""
    group = WorkerGroup.objects.get(pk=group_id)
    return render_to_string("dashboard/partials/group_phases.html", {"group": group, "phases": phase_figures(phases)})


def render_fleet_load(summary: Mapping[int, Mapping[str, float]]) -> str:
    """``<div id="fleet-kv">``: per pipeline (by name; ids of deleted pipelines are left out), its instances'
    KV cache use and prefix hit rate (means), requests and tokens/s (sums), as controlplane/live/fleet_load.py
    ``summarise`` gives them; what to start when nothing has reported. One query."""
    names = dict(Pipeline.objects.filter(pk__in=list(summary)).values_list("pk", "name"))
    rows = [
        {"pipeline_id": pk, "name": names[pk], "figures": _FigureDefaults(summary[pk])}
        for pk in sorted(names, key=lambda pk: names[pk])
    ]
    return render_to_string("dashboard/partials/fleet_load.html", {"rows": rows})


class _FigureDefaults(dict[str, float | None]):
    """A summary's figures where a missing one reads None in a template (not the empty string)."""

    def __missing__(self, key: str) -> None:
        return None


def render_audit_entry(entry_id: int) -> str:
    """``<ul hx-swap-oob="afterbegin:#audit-feed"><li id="audit-<pk>">…</li></ul>``: one audit entry to
    put at the top of the recent events. The ``<li>`` comes wrapped because htmx inserts the *children*
    of an out-of-band element for every swap style but outerHTML. Raises ``AuditEntry.DoesNotExist``."""
    entry = AuditEntry.objects.get(pk=entry_id)
    item = render_to_string("dashboard/partials/audit_entry.html", {"entry": entry})
    return format_html('<ul hx-swap-oob="afterbegin:#{}">{}</ul>', AUDIT_FEED_ID, item)


def render_download(download_id: int) -> str:
    """``<div id="download-<pk>" class="tr">``: model, node, a progress bar and the state (with the error,
    if any). Raises ``Download.DoesNotExist``."""
    download = queries.downloads_with_names().get(pk=download_id)
    return render_to_string("dashboard/partials/download.html", {"download": download})


def render_pipeline_planner(pipeline_id: int, *, can_act: bool) -> str:
    """``<div id="planner-<pk>">``: the planner's targets, the latest measurement and prediction against
    them, the recent decisions with their reasons, and the form that sets the mode and targets. Raises
    ``Pipeline.DoesNotExist``."""
    pipeline = Pipeline.objects.select_related("model").get(pk=pipeline_id)
    context = {"panel": planner_panel.panel(pipeline), "can_act": can_act}
    return render_to_string("dashboard/partials/pipeline_planner.html", context)


def instances_context(pipeline: Pipeline) -> dict[str, Any]:
    """What ``partials/pipeline_instances.html`` needs (the pipeline page includes it too)."""
    return {"pipeline": pipeline, "instances": queries.pipeline_instances(pipeline)}


#: How the load partial names each tier below the device (runtime/kv/events.py ``Medium``).
TIER_NAMES = {"cpu": "host", "disk": "disk", "external": "external"}


@dataclass(frozen=True)
class TierFigures:
    """One KV tier below the device, over the instance's ranks: blocks held of its size, and its hit rate."""

    name: str
    used_blocks: float | None = None
    total_blocks: float | None = None
    usage: float | None = None
    hit_rate: float | None = None


@dataclass(frozen=True)
class LoadFigures:
    """A worker's load as the load partial shows it: text for people, attributes for charts.js."""

    at: float
    kv_usage: float | None = None
    prefix_hit_rate: float | None = None
    running: float | None = None
    waiting: float | None = None
    active_requests: float | None = None
    tokens_per_s: float | None = None
    #: Disaggregated serving: prompts computed for decode workers, KV handoffs taken (totals), and their mean
    #: milliseconds (arrival to handoff; arrival to first token) over the last interval that had some.
    prefills: float | None = None
    prefill_ms: float | None = None
    handoffs: float | None = None
    handoff_first_token_ms: float | None = None
    #: The KV tiers below the device, best first (none: the engine offloads nothing).
    tiers: tuple[TierFigures, ...] = ()

    @property
    def data_attributes(self) -> list[tuple[str, str]]:
        """``(name, value)`` of each ``data-*`` attribute, numbers written the same way in every locale."""
        pairs = [("at", f"{self.at:.3f}")]
        for name in ("kv_usage", "prefix_hit_rate", "running", "waiting", "active_requests", "tokens_per_s"):
            value = getattr(self, name)
            if value is not None:
                pairs.append((name.replace("_", "-"), f"{value:g}"))
        return pairs


def load_figures(load: Mapping[str, Any] | None) -> LoadFigures | None:
    """The figures of a ``WorkerLoad`` dict that are finite numbers (None: no load reported yet)."""
    if load is None:
        return None
    numbers = {name: _number(value) for name, value in load.items() if name != "tiers"}
    at = numbers.get("at")
    return LoadFigures(
        at=time.time() if at is None else at,
        kv_usage=numbers.get("kv_usage"),
        prefix_hit_rate=numbers.get("prefix_hit_rate"),
        running=numbers.get("running"),
        waiting=numbers.get("waiting"),
        active_requests=numbers.get("active_requests"),
        tokens_per_s=numbers.get("tokens_per_s"),
        prefills=numbers.get("prefills"),
        prefill_ms=numbers.get("prefill_ms"),
        handoffs=numbers.get("handoffs"),
        handoff_first_token_ms=numbers.get("handoff_first_token_ms"),
        tiers=tier_figures(load.get("tiers")),
    )


@dataclass(frozen=True)
class PhaseFigures:
    """A worker group's phases as its partial shows them (controlplane/live/group_phases.py ``summarise``)."""

    instances: float | None = None
    prefills: float | None = None
    prefills_per_s: float | None = None
    prefill_ms: float | None = None
    handoffs: float | None = None
    handoffs_per_s: float | None = None
    handoff_first_token_ms: float | None = None


def phase_figures(phases: Mapping[str, Any] | None) -> PhaseFigures | None:
    """The figures of a group's phases that are finite numbers (None: nothing counted yet)."""
    if phases is None:
        return None
    names = PhaseFigures.__dataclass_fields__
    return PhaseFigures(**{name: _number(value) for name, value in phases.items() if name in names})


def tier_figures(tiers: Any) -> tuple[TierFigures, ...]:
    """The tiers of a load dict (the bridge's ``sum_tiers``) that name a known tier; their figures that are
    finite numbers."""
    if not isinstance(tiers, list):
        return ()
    figures = []
    for tier in tiers:
        if not isinstance(tier, Mapping) or tier.get("medium") not in TIER_NAMES:
            continue
        figures.append(
            TierFigures(
                name=TIER_NAMES[tier["medium"]],
                used_blocks=_number(tier.get("used_blocks")),
                total_blocks=_number(tier.get("total_blocks")),
                usage=_number(tier.get("usage")),
                hit_rate=_number(tier.get("hit_rate")),
            )
        )
    return tuple(figures)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)
