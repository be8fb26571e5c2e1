"""The control plane's changes, turned into change notices for the dashboard's sockets after commit.

Three sources together cover every change a page shows:

* audit entries (``entry_committed``, sent once an action's transaction commits): every audited change,
  the conditional ``.update()`` calls of the actions and the reconciler included (instance transitions,
  placements, dispatches, a node gone offline, a pipeline scaled);
* ``post_save``/``post_delete`` of models, nodes, GPUs, pipelines, worker groups, instances and
  downloads, sent on commit: the saves that write no audit entry, chiefly a heartbeat that moves only
  usage figures (``Node.save``) and a download's progress (``Download.save``);
* ``row_changed(row)``, called by the one unaudited ``.update()`` a page shows: an agent's report that
  changes an instance's details (download progress, pid) but not its state.

A change reaches several groups when several pages show it: an instance is on its pipeline's page, and
its state moves the pipeline's ready count on the fleet pages. A row that is created or deleted changes
its list: the list is pushed instead of the row (a new row has no element to swap, a deleted one would
stay), while a changed row is pushed alone. Models are the exception: the catalog is pushed whole on any
change of a model, since its rows are table rows (controlplane/dashboard/partials.py).

Notices of one row within one burst become one (controlplane/live/publisher.py); a rolled-back
transaction sends none.
"""

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from django.apps import apps
from django.db import models, transaction
from django.db.models.signals import post_delete, post_save

from controlplane.audit.models import AuditEntry
from controlplane.audit.records import entry_committed
from controlplane.catalog.models import LanguageModel
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance, Pipeline, WorkerGroup
from controlplane.fleet.models import Download, Gpu, Node
from controlplane.live.groups import AUDIT, DOWNLOADS, FLEET_LIST, MODELS, NODES, PIPELINES, Kind, pipeline_group
from controlplane.live.publisher import Publisher

log = logging.getLogger(__name__)

Notice = tuple[Kind, int, frozenset[str]]
# The actions that may start a rolling update (their instances' rows then read "old settings").
_ROLLOUT_ACTIONS = frozenset({"pipeline.update", "pipeline.update_group"})
_WATCHED: tuple[type[models.Model], ...] = (LanguageModel, Node, Gpu, Pipeline, WorkerGroup, Instance, Download)


def connect(publisher: Publisher) -> None:
    """Send ``publisher`` a notice for each committed change from now on (idempotent)."""

    def row_saved_or_deleted(sender: type[models.Model], instance: models.Model, **kwargs: Any) -> None:
        # post_delete sends no "created": a deleted row leaves its list as a new one joins it.
        joined_or_left = kwargs.get("created", True)
        notices = list(notices_of_row(instance, joined_or_left=joined_or_left))
        # robust: the change is committed; nothing of ours may turn the request into an error now.
        transaction.on_commit(lambda: _publish(publisher, notices), robust=True)

    def entry_recorded(sender: type[AuditEntry], entry: AuditEntry, **kwargs: Any) -> None:
        # entry_committed is sent after the commit already, and not robustly: nothing may escape here.
        try:
            _publish(publisher, notices_of_entry(entry))
        except Exception:
            log.exception("live updates: no notice for audit entry %s", entry.pk)

    for model in _WATCHED:
        uid = f"live-{model._meta.label_lower}"
        post_save.connect(row_saved_or_deleted, sender=model, weak=False, dispatch_uid=f"{uid}-save")
        post_delete.connect(row_saved_or_deleted, sender=model, weak=False, dispatch_uid=f"{uid}-delete")
    entry_committed.connect(entry_recorded, sender=AuditEntry, weak=False, dispatch_uid="live-audit")


def row_changed(row: models.Model) -> None:
    """Tell the pages that show ``row`` (a model, node, GPU, pipeline, worker group, instance or download)
    once the current transaction commits.

    For changes written with ``.update()`` and no audit entry, which send no signal; a no-op when the live
    app is not installed.
    """
    try:
        publisher: Publisher = apps.get_app_config("live").publisher
    except LookupError:
        return
    notices = list(notices_of_row(row))
    transaction.on_commit(lambda: _publish(publisher, notices), robust=True)


def planner_changed(pipeline_id: int) -> None:
    """Tell pipeline ``pipeline_id``'s page that its planner decided (its panel is rendered again); call it
    after commit. A no-op when the live app is not installed."""
    try:
        publisher: Publisher = apps.get_app_config("live").publisher
    except LookupError:
        return
    _publish(publisher, _planner(pipeline_id))


def notices_of_row(row: models.Model, *, joined_or_left: bool = False) -> Iterator[Notice]:
    """The notices a saved or deleted row of a watched model calls for (``joined_or_left``: it was
    created or deleted, which changes the list it is in)."""
    if isinstance(row, LanguageModel):
        yield from _models()
    elif isinstance(row, Node):
        yield from _node(row.pk, joined_or_left=joined_or_left)
    elif isinstance(row, Gpu):
        yield from _node(row.node_id)
    elif isinstance(row, Pipeline):
        yield from _pipeline(row.pk, joined_or_left=joined_or_left)
    elif isinstance(row, WorkerGroup):
        yield from _pipeline(row.pipeline_id)
    elif isinstance(row, Instance):
        yield from _instance(row.pk, row.pipeline_id, listed_or_unlisted=joined_or_left)
    elif isinstance(row, Download):
        yield from _download(row.pk, joined_or_left=joined_or_left)


def notices_of_entry(entry: AuditEntry) -> Iterator[Notice]:
    """The entry itself (the fleet pages list recent events) and the row it is about, when a page shows it."""
    yield "audit", entry.pk, frozenset({AUDIT})
    try:
        target = int(entry.target_id)
    except ValueError:
        return
    kind = entry.target_type
    created_or_deleted = entry.before is None or entry.after is None
    if kind == "languagemodel":
        yield from _models()
    elif kind == "node":
        yield from _node(target, joined_or_left=created_or_deleted)
    elif kind == "pipeline":
        yield from _pipeline(target, joined_or_left=created_or_deleted)
        if entry.action == "pipeline.update":  # the planner's targets may have changed
            yield from _planner(target)
        if entry.action in _ROLLOUT_ACTIONS:
            # A new generation makes the running instances old ones at once (a bulk update, no row saved).
            yield "instances", target, frozenset({pipeline_group(target)})
    elif kind == "download":
        yield from _download(target, joined_or_left=created_or_deleted)
    elif kind == "instance":
        pipeline = _snapshot_field(entry, "pipeline")
        if pipeline is not None:
            # A stopped instance leaves its pipeline's list (controlplane/dashboard/queries.py).
            stopped = isinstance(entry.after, dict) and entry.after.get("state") == InstanceState.STOPPED
            yield from _instance(target, pipeline, listed_or_unlisted=entry.before is None or stopped)
    elif kind == "workergroup":
        pipeline = _snapshot_field(entry, "pipeline")
        if pipeline is not None:
            yield from _pipeline(pipeline)


def _models() -> Iterator[Notice]:
    yield "models", FLEET_LIST, frozenset({MODELS})


def _node(node_id: int, *, joined_or_left: bool = False) -> Iterator[Notice]:
    if joined_or_left:
        yield "nodes", FLEET_LIST, frozenset({NODES})
    else:
        yield "node", node_id, frozenset({NODES})


def _download(download_id: int, *, joined_or_left: bool = False) -> Iterator[Notice]:
    if joined_or_left:
        yield "downloads", FLEET_LIST, frozenset({DOWNLOADS})
    else:
        yield "download", download_id, frozenset({DOWNLOADS})


def _pipeline(pipeline_id: int, *, joined_or_left: bool = False) -> Iterator[Notice]:
    if joined_or_left:
        # The fleet's list, and the catalog's count of pipelines per model; the pipeline's own page
        # (a deleted pipeline's, still open) shows its row.
        yield "pipelines", FLEET_LIST, frozenset({PIPELINES})
        yield "models", FLEET_LIST, frozenset({MODELS})
        yield "pipeline", pipeline_id, frozenset({pipeline_group(pipeline_id)})
    else:
        yield "pipeline", pipeline_id, frozenset({PIPELINES, pipeline_group(pipeline_id)})


def _planner(pipeline_id: int) -> Iterator[Notice]:
    yield "planner", pipeline_id, frozenset({pipeline_group(pipeline_id)})


def _instance(instance_id: int, pipeline_id: int, *, listed_or_unlisted: bool = False) -> Iterator[Notice]:
    group = frozenset({pipeline_group(pipeline_id)})
    if listed_or_unlisted:
        # A new instance has no element of its own on the page yet: the whole list is rendered again.
        yield "instances", pipeline_id, group
    else:
        yield "instance", instance_id, group
    # Its state moves the pipeline's ready count.
    yield from _pipeline(pipeline_id)


def _snapshot_field(entry: AuditEntry, name: str) -> int | None:
    for values in (entry.after, entry.before):
        if isinstance(values, dict) and isinstance(values.get(name), int):
            return int(values[name])
    return None


def _publish(publisher: Publisher, notices: Iterable[Notice]) -> None:
    for kind, row_id, groups in notices:
        publisher.publish(kind, row_id, groups)
