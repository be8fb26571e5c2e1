"""The dashboard's LoRA adapters: a model's (add, delete) on its page, and a pipeline's Adapters panel (load,
unload, and which of its instances serve each).

The buttons are POSTs for operators and admins (403 for read-only people, whose pages leave them out), calling
the same actions as the API (catalog/adapters.py, deployments/adapters.py) and going back to the page with a
note: what was done, or why not (the action's message).

Which instances serve an adapter is what the workers registered in etcd: one model entry per adapter each
serves (``flotilla/models/<namespace>/...`` with ``lora`` set, runtime/lora.py), matched to the pipeline's
instances by their worker id. It is what the fleet does, not what it was told: an adapter whose download
failed on a node is loaded and served by none of that node's instances.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from django.contrib import messages
from django.http import HttpRequest, HttpResponseBase
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from controlplane.audit.records import Actor
from controlplane.catalog import adapters as catalog_adapters
from controlplane.catalog.models import LanguageModel
from controlplane.dashboard.access import ACT_ROLE, role_required
from controlplane.deployments import adapters as adapter_actions
from controlplane.deployments.instance_states import LIVE_STATES
from controlplane.deployments.models import Instance, Pipeline
from controlplane.errors import Conflict, Invalid
from controlplane.etcd_records import read_prefix
from controlplane.fleet.models import Node
from runtime.cluster.discovery import MODELS_PREFIX
from runtime.lora import LoraInfo


class _Registered(msgspec.Struct):
    """What the panel reads of a worker's model entry (runtime/endpoint.py's ModelEntry)."""

    instance_id: int
    lora: LoraInfo | None = None


@dataclass
class AdapterRow:
    name: str
    source: str
    loaded: bool
    #: The names of the pipeline's instances whose workers registered it; None: etcd could not be read.
    served_by: list[str] | None = field(default_factory=list)
    #: "node: why" for each node of the pipeline's instances that could not fetch it (its agent's heartbeat).
    failed_on: list[str] = field(default_factory=list)


def adapter_rows(pipeline: Pipeline) -> list[AdapterRow]:
    """Each adapter of the pipeline's model: loaded here or not, and which instances serve it."""
    loaded = set(pipeline.adapters.values_list("pk", flat=True))
    served = served_adapters(pipeline)
    failed = adapter_failures(pipeline)
    return [
        AdapterRow(
            name=adapter.name,
            source=adapter.source_display,
            loaded=adapter.pk in loaded,
            served_by=None if served is None else sorted(served.get(adapter.name, [])),
            failed_on=failed.get(adapter.name, []),
        )
        for adapter in pipeline.model.adapters.all()
    ]


def adapter_failures(pipeline: Pipeline) -> dict[str, list[str]]:
    """Adapter name -> "node: why" for each node running an instance of the pipeline whose agent could not fetch
    it. A node's word counts only for pipelines it runs an instance of: what it says of others is not shown."""
    nodes = Node.objects.filter(instances__pipeline=pipeline, instances__state__in=LIVE_STATES).distinct()
    found: dict[str, list[str]] = {}
    for node in nodes.order_by("name"):
        for failure in node.adapter_failures:
            if isinstance(failure, dict) and failure.get("pipeline_id") == pipeline.pk:
                found.setdefault(str(failure.get("adapter")), []).append(f"{node.name}: {failure.get('reason', '')}")
    return found


def served_adapters(pipeline: Pipeline) -> dict[str, list[str]] | None:
    """Adapter name -> the names of the pipeline's instances whose workers registered it in etcd; None when etcd
    cannot be read."""
    records = read_prefix(f"{MODELS_PREFIX}{pipeline.namespace}/")
    if records is None:
        return None
    instances = {
        instance.endpoint_instance_id: instance.name
        for instance in Instance.objects.select_related("pipeline", "group").filter(
            pipeline=pipeline, endpoint_instance_id__isnull=False
        )
    }
    served: dict[str, list[str]] = {}
    for value in records.values():
        try:
            entry = msgspec.json.decode(value, type=_Registered)
        except msgspec.DecodeError:
            continue  # not a model entry this version reads: nothing to show of it
        if entry.lora is not None and entry.instance_id in instances:
            served.setdefault(entry.lora.name, []).append(instances[entry.instance_id])
    return served


@role_required(ACT_ROLE)
@require_POST
def model_adapter_add(request: HttpRequest, pk: int) -> HttpResponseBase:
    model = get_object_or_404(LanguageModel, pk=pk)
    fields = {
        name: request.POST.get(name, "").strip() for name in ("name", "source_kind", "source", "revision", "filename")
    }
    try:
        adapter = catalog_adapters.create_adapter(Actor.person(request.user), model, **fields)
    except (Invalid, Conflict) as exc:
        messages.error(request, f"Adapter not added: {exc}")
    else:
        messages.success(request, f"Adapter {adapter.name} added to {model.name}.")
    return redirect("dashboard:model", pk=model.pk)


@role_required(ACT_ROLE)
@require_POST
def model_adapter_delete(request: HttpRequest, pk: int) -> HttpResponseBase:
    model = get_object_or_404(LanguageModel, pk=pk)
    adapter = get_object_or_404(model.adapters, name=request.POST.get("adapter", ""))
    try:
        catalog_adapters.delete_adapter(Actor.person(request.user), adapter)
    except Conflict as exc:
        messages.error(request, f"Adapter not deleted: {exc}")
    else:
        messages.success(request, f"Adapter {adapter.name} deleted.")
    return redirect("dashboard:model", pk=model.pk)


@role_required(ACT_ROLE)
@require_POST
def pipeline_adapter_load(request: HttpRequest, pk: int) -> HttpResponseBase:
    return _on_pipeline_adapter(
        request, pk, adapter_actions.load_adapter, "loaded", "{name} loaded on {pipeline}: its workers load it now."
    )


@role_required(ACT_ROLE)
@require_POST
def pipeline_adapter_unload(request: HttpRequest, pk: int) -> HttpResponseBase:
    return _on_pipeline_adapter(
        request, pk, adapter_actions.unload_adapter, "unloaded", "{name} unloaded from {pipeline}."
    )


def _on_pipeline_adapter(
    request: HttpRequest,
    pk: int,
    action: Callable[[Actor, Pipeline, str], object],
    done: str,
    success: str,
) -> HttpResponseBase:
    """Load or unload (``action``) the posted adapter on pipeline ``pk``, and say how it went."""
    pipeline = get_object_or_404(Pipeline, pk=pk)
    name = request.POST.get("adapter", "")
    try:
        action(Actor.person(request.user), pipeline, name)
    except (Invalid, Conflict) as exc:
        messages.error(request, f"Adapter not {done}: {exc}")
    else:
        messages.success(request, "Adapter " + success.format(name=name, pipeline=pipeline.name))
    return redirect("dashboard:pipeline", pk=pipeline.pk)
