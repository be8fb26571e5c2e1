"""Edit a pipeline, delete a pipeline or a model: for operators and admins, as in the API.

The edit page is a plain form (``pipeline_edit.PipelineEditForm``): a refusal comes back with the form and
the reason by the field at fault (400), a change redirects to the pipeline's page, which shows the rolling
update live. Deleting calls the API's actions (``delete_pipeline``, ``delete_model``), which refuse a
running pipeline ("stop it first") and a model that pipelines use (naming them): the refusal is the page's
note (409), and nothing is deleted. A delete button is an htmx POST (the browser asks first); without
JavaScript the form posts the same way and the answer is a redirect with the note.
"""

from collections.abc import Callable

from django.contrib import messages
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import get_object_or_404, redirect
from django.template.loader import render_to_string
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_POST

from controlplane.audit.records import Actor
from controlplane.catalog import actions as catalog_actions
from controlplane.catalog.models import LanguageModel
from controlplane.dashboard.access import ACT_ROLE, role_required
from controlplane.dashboard.pipeline_edit import PipelineEditForm
from controlplane.dashboard.views import render_page
from controlplane.deployments import pipelines as pipeline_actions
from controlplane.deployments.models import Pipeline
from controlplane.errors import Conflict


@role_required(ACT_ROLE)
@require_http_methods(["GET", "POST"])
def pipeline_edit(request: HttpRequest, pk: int) -> HttpResponseBase:
    """The edit form, filled with the pipeline's settings; its POST makes the changes."""
    pipeline = get_object_or_404(Pipeline.objects.select_related("model"), pk=pk)
    status = 200
    if request.method == "POST":
        form = PipelineEditForm(pipeline, request.POST)
        edit = form.submit(Actor.person(request.user))
        if edit is not None:
            if not edit.changed:
                messages.info(request, f"Nothing changed in {pipeline.name}.")
            else:
                note = f"{pipeline.name} updated: {', '.join(edit.changed)}."
                if edit.rolling:
                    note += " Its workers are replaced one at a time, each new one ready before an old one stops."
                messages.success(request, note)
            return redirect("dashboard:pipeline", pk=pipeline.pk)
        status = 400
    else:
        form = PipelineEditForm(pipeline)
    context = {"pipeline": pipeline, "form": form}
    return render_page(request, "dashboard/pipeline_edit.html", context, status=status)


@role_required(ACT_ROLE)
@require_POST
def pipeline_delete(request: HttpRequest, pk: int) -> HttpResponseBase:
    pipeline = get_object_or_404(Pipeline, pk=pk)
    return _delete(
        request,
        lambda actor: pipeline_actions.delete_pipeline(actor, pipeline),
        done=(f"Pipeline {pipeline.name} deleted.", reverse("dashboard:pipelines")),
        refused=(f"{pipeline.name} not deleted", reverse("dashboard:pipeline", args=[pipeline.pk])),
    )


@role_required(ACT_ROLE)
@require_POST
def model_delete(request: HttpRequest, pk: int) -> HttpResponseBase:
    model = get_object_or_404(LanguageModel, pk=pk)
    return _delete(
        request,
        lambda actor: catalog_actions.delete_model(actor, model),
        done=(f"Model {model.name} deleted.", reverse("dashboard:models")),
        refused=(f"{model.name} not deleted", reverse("dashboard:model", args=[model.pk])),
    )


def _delete(
    request: HttpRequest,
    action: Callable[[Actor], None],
    *,
    done: tuple[str, str],
    refused: tuple[str, str],
) -> HttpResponseBase:
    """Run ``action``; then go to ``done``'s page with its note, or stay with ``refused``'s note and the reason
    (each a note and the page it belongs to)."""
    try:
        action(Actor.person(request.user))
    except Conflict as exc:
        note, page = f"{refused[0]}: {exc}.", refused[1]
        if not request.headers.get("HX-Request"):
            messages.error(request, note)
            return redirect(page)
        # The record is still there, and so is the page: only the note changes (the form swaps nothing).
        flash = render_to_string("dashboard/partials/flash.html", {"notes": [(note, False)], "out_of_band": True})
        return HttpResponse(flash, status=409)
    note, page = done
    messages.success(request, note)
    if not request.headers.get("HX-Request"):
        return redirect(page)
    # The record's page is gone: htmx loads the list, which shows the note.
    return HttpResponse(status=204, headers={"HX-Redirect": page})
