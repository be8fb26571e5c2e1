"""The dashboard's buttons: scale, stop and start a pipeline, restart an instance, cordon and drain a node.

Each is a POST for operators and admins (403 for read-only people, CSRF-checked like every form) that
calls the action and answers htmx with the record's fresh partial, which replaces the one clicked, and a
note for the page's flash area. A refusal of the action (Invalid 400, Conflict 409) answers the same way
with the reason as the note; the page's htmx config swaps those statuses in. A request that is not from
htmx (no JavaScript) is redirected to the record's page with the note as a message.
"""

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from django.contrib import messages
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import get_object_or_404, redirect
from django.template.loader import render_to_string
from django.urls import reverse
from django.views.decorators.http import require_POST

from controlplane.audit.records import Actor
from controlplane.dashboard import partials
from controlplane.dashboard.access import ACT_ROLE, role_required
from controlplane.dashboard.forms import ScaleForm
from controlplane.dashboard.planner_panel import PlannerForm
from controlplane.deployments import evacuation
from controlplane.deployments import instances as instance_actions
from controlplane.deployments import pipelines as pipeline_actions
from controlplane.deployments.models import Instance, Pipeline
from controlplane.errors import Conflict, Invalid
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Node


@role_required(ACT_ROLE)
@require_POST
def pipeline_scale(request: HttpRequest, pk: int) -> HttpResponseBase:
    pipeline = get_object_or_404(Pipeline, pk=pk)
    form = ScaleForm(request.POST)
    if not form.is_valid():
        problems = "; ".join(f"{field}: {' '.join(errors)}" for field, errors in form.errors.items())
        return _pipeline_answer(request, pipeline, f"Not scaled: {problems}", status=400)
    role = form.cleaned_data["role"] or None
    replicas = form.cleaned_data["replicas"]
    return _act(
        request,
        lambda actor: pipeline_actions.scale_pipeline(actor, pipeline, replicas, role),
        lambda: _pipeline_answer(request, pipeline, f"{pipeline.name} scaled to {replicas}."),
        lambda note, status: _pipeline_answer(request, pipeline, f"Not scaled: {note}", status=status),
    )


@role_required(ACT_ROLE)
@require_POST
def pipeline_planner(request: HttpRequest, pk: int) -> HttpResponseBase:
    """The planner panel's form: the mode and the targets every group shares."""
    pipeline = get_object_or_404(Pipeline, pk=pk)
    page = reverse("dashboard:pipeline", args=[pk])

    def answer(note: str, status: int = 200) -> HttpResponseBase:
        return _answer(request, partials.render_pipeline_planner(pk, can_act=True), note, status=status, page=page)

    form = PlannerForm(request.POST)
    if not form.is_valid():
        problems = "; ".join(f"{field}: {' '.join(errors)}" for field, errors in form.errors.items())
        return answer(f"Planner settings not saved: {problems}", 400)
    document = form.document(pipeline.planner)
    return _act(
        request,
        lambda actor: pipeline_actions.update_pipeline(actor, pipeline, planner=document),
        lambda: answer(f"Planner settings of {pipeline.name} saved."),
        lambda note, status: answer(f"Planner settings not saved: {note}", status),
    )


@role_required(ACT_ROLE)
@require_POST
def pipeline_stop(request: HttpRequest, pk: int) -> HttpResponseBase:
    pipeline = get_object_or_404(Pipeline, pk=pk)
    return _act(
        request,
        lambda actor: pipeline_actions.stop_pipeline(actor, pipeline),
        lambda: _pipeline_answer(request, pipeline, f"{pipeline.name} stopped."),
        lambda note, status: _pipeline_answer(request, pipeline, note, status=status),
    )


@role_required(ACT_ROLE)
@require_POST
def pipeline_start(request: HttpRequest, pk: int) -> HttpResponseBase:
    pipeline = get_object_or_404(Pipeline, pk=pk)
    return _act(
        request,
        lambda actor: pipeline_actions.start_pipeline(actor, pipeline),
        lambda: _pipeline_answer(request, pipeline, f"{pipeline.name} started."),
        lambda note, status: _pipeline_answer(request, pipeline, note, status=status),
    )


@role_required(ACT_ROLE)
@require_POST
def instance_restart(request: HttpRequest, pk: int) -> HttpResponseBase:
    instance = get_object_or_404(Instance.objects.select_related("pipeline", "group"), pk=pk)
    page = reverse("dashboard:pipeline", args=[instance.pipeline_id])

    def answer(note: str, status: int = 200) -> HttpResponseBase:
        return _answer(request, partials.render_instance(instance.pk, can_act=True), note, status=status, page=page)

    return _act(
        request,
        lambda actor: instance_actions.restart_instance(actor, instance),
        lambda: answer(f"{instance.name} is restarting."),
        answer,
    )


@role_required(ACT_ROLE)
@require_POST
def node_drain(request: HttpRequest, pk: int) -> HttpResponseBase:
    node = get_object_or_404(Node, pk=pk)
    force = request.POST.get("force") == "1"
    done = f"{node.name} is draining: each of its instances stops once its replacement elsewhere is ready."
    if force:
        done = f"{node.name} is draining: its instances were stopped; their replacements wait for room."
    return _act(
        request,
        lambda actor: evacuation.drain_node(actor, node, force=force),
        lambda: _node_answer(request, node, done),
        # A refusal for stranded pipelines offers "Drain anyway", which says what it stops.
        lambda note, status: _node_answer(request, node, note, status=status, offer_forced_drain=status == 409),
    )


@role_required(ACT_ROLE)
@require_POST
def node_cordon(request: HttpRequest, pk: int) -> HttpResponseBase:
    return _node_intent(
        request, pk, fleet_actions.cordon_node, "{name} is cordoned: nothing new is placed there; its instances stay."
    )


@role_required(ACT_ROLE)
@require_POST
def node_uncordon(request: HttpRequest, pk: int) -> HttpResponseBase:
    return _node_intent(request, pk, fleet_actions.uncordon_node, "New instances may be placed on {name} again.")


@role_required(ACT_ROLE)
@require_POST
def node_undrain(request: HttpRequest, pk: int) -> HttpResponseBase:
    return _node_intent(request, pk, evacuation.undrain_node, "New instances may be placed on {name} again.")


def _node_intent(request: HttpRequest, pk: int, action: Callable[[Actor, Node], Node], done: str) -> HttpResponseBase:
    """Run a node action that only sets the operator's intent (cordon, uncordon, undrain); answer with the
    node's row and ``done`` (``{name}`` is the node's name), or the refusal."""
    node = get_object_or_404(Node, pk=pk)
    return _act(
        request,
        lambda actor: action(actor, node),
        lambda: _node_answer(request, node, done.format(name=node.name)),
        lambda note, status: _node_answer(request, node, note, status=status),
    )


def _act(
    request: HttpRequest,
    action: Callable[[Actor], Any],
    done: Callable[[], HttpResponseBase],
    refused: Callable[[str, int], HttpResponseBase],
) -> HttpResponseBase:
    """Run ``action`` as the person; answer with ``done()``, or ``refused(reason, status)``."""
    try:
        action(Actor.person(request.user))
    except Invalid as exc:
        return refused(exc.message, 400)
    except Conflict as exc:
        return refused(str(exc), 409)
    return done()


def _pipeline_answer(request: HttpRequest, pipeline: Pipeline, note: str, *, status: int = 200) -> HttpResponseBase:
    """The pipeline's row; from its own page also its instances, which scale, stop and start change."""
    page = reverse("dashboard:pipeline", args=[pipeline.pk])
    html = partials.render_pipeline_row(pipeline.pk, can_act=True)
    extra = ""
    if _current_path(request) == page:
        context = partials.instances_context(pipeline) | {"out_of_band": True, "can_act": True}
        extra = render_to_string("dashboard/partials/pipeline_instances.html", context)
    return _answer(request, html, note, status=status, page=page, out_of_band=extra)


def _node_answer(
    request: HttpRequest, node: Node, note: str, *, status: int = 200, offer_forced_drain: bool = False
) -> HttpResponseBase:
    html = partials.render_node(node.pk, can_act=True, offer_forced_drain=offer_forced_drain)
    return _answer(request, html, note, status=status, page=reverse("dashboard:nodes"))


def _answer(
    request: HttpRequest, html: str, note: str, *, status: int, page: str, out_of_band: str = ""
) -> HttpResponseBase:
    """``html`` for the clicked element, then the note and ``out_of_band`` elements, swapped by their ids."""
    ok = status < 400
    if not request.headers.get("HX-Request"):
        (messages.success if ok else messages.error)(request, note)
        return redirect(page)
    flash = render_to_string("dashboard/partials/flash.html", {"notes": [(note, ok)], "out_of_band": True})
    return HttpResponse(html + flash + out_of_band, status=status)


def _current_path(request: HttpRequest) -> str:
    """The path of the page htmx sent the request from (its ``HX-Current-URL`` header)."""
    return urlsplit(request.headers.get("HX-Current-URL", "")).path
