"""The dashboard's pages: server-rendered, for people who are logged in.

Every page may be read by every role. The two pages with a form (models, pipelines) take its POST too,
for operators and admins only; the buttons' POSTs are in controls.py.
"""

import dataclasses
import json
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.cache import cache
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.views.decorators.http import require_GET, require_http_methods

from controlplane.accounts.models import Role
from controlplane.audit.records import Actor
from controlplane.catalog import actions as catalog_actions
from controlplane.catalog.models import LanguageModel
from controlplane.dashboard import adapters, audit_log, gateway, hub_search, logs, partials, planner_panel, queries
from controlplane.dashboard.access import AUDIT_ROLE, can_act, has_role, role_required
from controlplane.dashboard.alert_counts import BADGE_EVERY_S, firing_count
from controlplane.dashboard.fleet_health import fleet_health
from controlplane.dashboard.forms import AuditFilterForm, ModelForm, PipelineForm
from controlplane.dashboard.overview import overview
from controlplane.deployments.models import Pipeline
from controlplane.errors import InvalidDocument
from controlplane.traffic import queries as traffic_queries
from runtime.errors import ConfigError

# The previous gateway reading, for rates between two looks at the overview (see gateway.py).
GATEWAY_READING_KEY = "dashboard:gateway-reading"
#: How often an open overview reads the gateway's traffic (and the fleet's health) again.
GATEWAY_EVERY_S = 5
#: The Add-model form's fields that a link may fill (``/models/?source=…``).
ADD_FORM_PREFILL = ("name", "source_kind", "source", "revision", "filename", "projector", "engine")
#: How often an open pipeline page reads its router view (its last requests) again.
ROUTER_VIEW_EVERY_S = 5


def render_page(request: HttpRequest, template: str, context: dict[str, Any], *, status: int = 200) -> HttpResponse:
    """Render a page with what base.html needs to know about the person's role."""
    context = {
        "can_act": can_act(request),
        "can_read_audit": has_role(request, AUDIT_ROLE),
        "can_manage_people": has_role(request, Role.ADMIN),
        **context,
    }
    return render(request, template, context, status=status)


@login_required
@require_GET
def overview_page(request: HttpRequest) -> HttpResponse:
    """Nodes and GPUs, pipelines with ready/desired replicas, gateway traffic and the latest audit events."""
    summary = overview(with_events=has_role(request, AUDIT_ROLE))
    context = {
        "overview": summary,
        "gateway_every_s": GATEWAY_EVERY_S,
        "firing_alerts": firing_count(),
        "alerts_every_s": BADGE_EVERY_S,
    }
    return render_page(request, "dashboard/overview.html", context)


@login_required
@require_GET
def gateway_section(request: HttpRequest) -> HttpResponse:
    """The overview's gateway traffic (loaded after the page, so a slow gateway does not hold it up, then every
    ``GATEWAY_EVERY_S``), and the fleet's health out of band."""
    context: dict[str, Any] = {"url": None, "traffic": None, "problem": None, "every_s": GATEWAY_EVERY_S}
    try:
        url = gateway.gateway_url()
    except ConfigError as exc:
        context["problem"] = str(exc)
        return _gateway_answer(request, context)
    context["url"] = url
    if url is not None:
        try:
            reading = gateway.read_gateway(url)
        except gateway.GatewayUnreachable as exc:
            context["problem"] = str(exc)
        else:
            previous = cache.get(GATEWAY_READING_KEY)
            cache.set(GATEWAY_READING_KEY, reading, timeout=int(gateway.MAX_RATE_WINDOW_S))
            context["traffic"] = gateway.traffic(reading, previous if isinstance(previous, gateway.Reading) else None)
    return _gateway_answer(request, context)


def _gateway_answer(request: HttpRequest, context: dict[str, Any]) -> HttpResponse:
    section = render_to_string("dashboard/partials/gateway.html", context, request=request)
    health = render_to_string("dashboard/partials/fleet_health.html", {"health": fleet_health(), "out_of_band": True})
    return HttpResponse(section + health)


@login_required
@require_http_methods(["GET", "POST"])
def models_page(request: HttpRequest) -> HttpResponseBase:
    """The catalog, the add-a-model form, and each model's downloads per node."""
    form = ModelForm(initial={"source_kind": LanguageModel.SourceKind.HUGGING_FACE, **_add_form_values(request)})
    status = 200
    if request.method == "POST":
        if not can_act(request):
            raise PermissionDenied("adding a model needs the operator role")
        form = ModelForm(request.POST)
        model = form.submit(Actor.person(request.user))
        if model is not None:
            messages.success(request, f"Model {model.name} added.")
            return redirect("dashboard:models")
        status = 400
    models = queries.models_with_pipeline_counts()
    context = {"models": models, "downloads": queries.downloads_with_names(), "form": form}
    context["search_form"] = hub_search.HubSearchForm()
    return render_page(request, "dashboard/models.html", context, status=status)


def _add_form_values(request: HttpRequest) -> dict[str, str]:
    """The Add-model form's values given in the query (hub_search's "Add this model" link): shown, not trusted;
    the form checks them when it is sent."""
    return {name: request.GET[name][:1024] for name in ADD_FORM_PREFILL if request.GET.get(name)}


@login_required
@require_http_methods(["GET", "POST"])
def model_page(request: HttpRequest, pk: int) -> HttpResponseBase:
    """One model: its profile (read-only JSON) and, for operators, a form to paste a new one or remove it."""
    model = get_object_or_404(LanguageModel, pk=pk)
    form = planner_panel.ProfileForm()
    status = 200
    if request.method == "POST":
        if not can_act(request):
            raise PermissionDenied("changing a profile needs the operator role")
        remove = request.POST.get("remove") == "1"
        form = planner_panel.ProfileForm(request.POST)
        if remove or form.is_valid():
            try:
                catalog_actions.set_profile(
                    Actor.person(request.user), model, None if remove else form.cleaned_data["profile"]
                )
            except InvalidDocument as exc:
                for path, message in exc.problems:
                    form.add_error("profile", f"{path}: {message}" if path else message)
            else:
                messages.success(request, f"Profile of {model.name} {'removed' if remove else 'saved'}.")
                return redirect("dashboard:model", pk=model.pk)
        status = 400
    document = json.dumps(model.profile, indent=2) if model.profile is not None else ""
    pipelines = list(model.pipelines.order_by("name").only("pk", "name"))
    context = {"model": model, "form": form, "document": document, "pipelines": pipelines}
    context["adapters"] = list(model.adapters.prefetch_related("pipelines"))
    context["estimate"] = hub_search.model_estimate_context(model)
    return render_page(request, "dashboard/model.html", context, status=status)


@login_required
@require_http_methods(["GET", "POST"])
def pipelines_page(request: HttpRequest) -> HttpResponseBase:
    """Pipelines with ready/desired replicas and their controls, and the deploy form."""
    form = PipelineForm()
    status = 200
    if request.method == "POST":
        if not can_act(request):
            raise PermissionDenied("deploying needs the operator role")
        form = PipelineForm(request.POST)
        pipeline = form.submit(Actor.person(request.user))
        if pipeline is not None:
            messages.success(request, f"Pipeline {pipeline.name} deployed.")
            return redirect("dashboard:pipeline", pk=pipeline.pk)
        status = 400
    rows = queries.pipeline_rows(queries.pipelines_with_groups())
    has_models = LanguageModel.objects.exists()
    context = {"rows": rows, "form": form, "has_models": has_models}
    return render_page(request, "dashboard/pipelines.html", context, status=status)


@login_required
@require_GET
def pipeline_page(request: HttpRequest, pk: int) -> HttpResponse:
    """One pipeline: its settings, its instances with their load charts, and an instance's log tail."""
    pipeline = get_object_or_404(queries.pipelines_with_groups(), pk=pk)
    (row,) = queries.pipeline_rows([pipeline])
    context = {"rows": [row], "pipeline": pipeline, "groups": list(pipeline.groups.all())}
    context |= partials.instances_context(pipeline)
    context["planner"] = planner_panel.panel(pipeline)
    context["routed"] = traffic_queries.router_view(pipeline.pk)
    context["every_s"] = ROUTER_VIEW_EVERY_S
    context["adapters"] = adapters.adapter_rows(pipeline)
    return render_page(request, "dashboard/pipeline.html", context)


@login_required
@require_GET
def pipeline_router_view(request: HttpRequest, pk: int) -> HttpResponse:
    """The pipeline page's router view (its last requests and where each went), which refreshes itself with this."""
    pipeline = get_object_or_404(Pipeline, pk=pk)
    routed = traffic_queries.router_view(pipeline.pk)
    return render(
        request,
        "dashboard/partials/router_view.html",
        {"pipeline": pipeline, "routed": routed, "every_s": ROUTER_VIEW_EVERY_S},
    )


@login_required
@require_GET
def nodes_page(request: HttpRequest) -> HttpResponse:
    """Nodes with their inventory, heartbeats and the drain button."""
    return render_page(request, "dashboard/nodes.html", {"nodes": list(queries.nodes_with_gpus())})


@role_required(AUDIT_ROLE)
@require_GET
def audit_page(request: HttpRequest) -> HttpResponse:
    """The audit log, filtered by actor, kind of action and object, newest first, a page at a time; the first
    page polls for newer entries."""
    form = AuditFilterForm(request.GET or None, target_types=audit_log.target_types())
    filters = form.cleaned_data if form.is_bound and form.is_valid() else {}
    entries = audit_log.filtered_entries(**{name: value for name, value in filters.items() if value})
    page = audit_log.page_of(entries, request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    context: dict[str, Any] = {"form": form, "page": page, "query": query.urlencode(), "poll": None}
    # The first page takes in new entries as they come (with the same filters); older pages stay as they are.
    if page.number == 1 and (not form.is_bound or form.is_valid()):
        newest = page.object_list[0].pk if page.object_list else 0
        context |= {"poll": audit_log.poll_url(request.GET, newest=newest), "poll_s": audit_log.POLL_S}
    return render_page(request, "dashboard/audit.html", context)


@login_required
@require_GET
def instance_log(request: HttpRequest, pk: int) -> HttpResponse:
    """The tail of an instance's worker log (or why there is none), for the pipeline page's log pane."""
    """With ``pane=text`` (the instance page's followed log), only the text, filtered by ``grep`` (a substring,
    ignoring case), and bad input is a 400 with its reason (swapped in all the same, see base.html)."""
    instance = get_object_or_404(queries.instances_with_places(), pk=pk)
    text_pane = request.GET.get("pane") == "text"
    grep = ""
    try:
        lines = logs.parse_lines(request.GET.get("lines"))
        grep = logs.parse_grep(request.GET.get("grep"))
    except ValueError as exc:
        tail = logs.LogTail(instance, logs.DEFAULT_LINES, problem=str(exc), status=400)
    else:
        tail = logs.log_tail(instance, lines)
        if tail.text is not None and grep:
            tail = dataclasses.replace(tail, text=logs.filter_lines(tail.text, grep))
    context = {"tail": tail, "instance": instance, "grep": grep}
    if text_pane:
        status = 400 if tail.status == 400 else 200
        return render(request, "dashboard/partials/instance_log_text.html", context, status=status)
    # The pipeline page shows the reason as text: the status stays 200 so that htmx swaps it in.
    return render(request, "dashboard/partials/instance_log.html", context)
