"""An audit entry's page (its before/after as a diff, a link to what it is about) and the audit log's poll for
entries newer than the newest it shows. Both need the audit role, as the log does."""

from django.db.models import Model
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.views.decorators.http import require_GET

from controlplane.accounts.models import Role
from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import Adapter, LanguageModel
from controlplane.dashboard import audit_log, audit_summary
from controlplane.dashboard.access import AUDIT_ROLE, has_role, role_required
from controlplane.dashboard.forms import AuditFilterForm
from controlplane.dashboard.views import render_page
from controlplane.deployments.models import Instance, Pipeline

# Records with a page of their own: the page's URL name, if the record is still there.
_OWN_PAGES: dict[str, tuple[type[Model], str]] = {
    "pipeline": (Pipeline, "dashboard:pipeline"),
    "languagemodel": (LanguageModel, "dashboard:model"),
    "instance": (Instance, "dashboard:instance"),
}
# Records shown as a row of a list page: the page and the row's element id prefix.
_LIST_PAGES: dict[str, tuple[str, str]] = {
    "node": ("dashboard:nodes", "node"),
    "apikey": ("dashboard:api-keys", "api-key"),
    "silence": ("dashboard:alerts", "silences"),
}


def target_url(entry: AuditEntry, *, can_manage_people: bool) -> str | None:
    """The dashboard page of what ``entry`` is about, or None (no such page, the record is gone, or the page is
    the people page and the reader may not open it)."""
    if not entry.target_id.isdigit():
        return None
    pk = int(entry.target_id)
    if entry.target_type in _OWN_PAGES:
        model, name = _OWN_PAGES[entry.target_type]
        return reverse(name, args=[pk]) if model._default_manager.filter(pk=pk).exists() else None
    if entry.target_type == "adapter":  # an adapter is listed on its model's page
        model_id = Adapter.objects.filter(pk=pk).values_list("model_id", flat=True).first()
        return reverse("dashboard:model", args=[model_id]) if model_id is not None else None
    if entry.target_type == "user" and can_manage_people:
        return f"{reverse('dashboard:people')}#person-{pk}"
    if entry.target_type in _LIST_PAGES:
        name, prefix = _LIST_PAGES[entry.target_type]
        anchor = prefix if prefix == "silences" else f"{prefix}-{pk}"
        return f"{reverse(name)}#{anchor}"
    return None


@role_required(AUDIT_ROLE)
@require_GET
def audit_entry_page(request: HttpRequest, pk: int) -> HttpResponse:
    """One entry: who, when, what about, its summary, and the diff of its before/after (changed keys first)."""
    entry = get_object_or_404(AuditEntry, pk=pk)
    changes = audit_summary.diff(entry.before, entry.after)
    context = {
        "entry": entry,
        "changed": [_row(change) for change in changes if change.changed],
        "unchanged": [_row(change) for change in changes if not change.changed],
        "target_url": target_url(entry, can_manage_people=has_role(request, Role.ADMIN)),
    }
    return render_page(request, "dashboard/audit_detail.html", context)


@role_required(AUDIT_ROLE)
@require_GET
def audit_newer(request: HttpRequest) -> HttpResponse:
    """The entries newer than ``after`` (the id of the newest the page shows) that the page's filters select,
    newest first, at most a page of them, and the poll again from the newest; 204 when there is none.
    A bad ``after`` or filter is a 400 saying what is wrong."""
    after = request.GET.get("after", "")
    if not after.isdigit():
        problem = f"after must be the id of the newest entry shown (a whole number), not {after!r}"
        return _problem(request, problem)
    form = AuditFilterForm(audit_log.filters_of(request.GET), target_types=audit_log.target_types())
    if not form.is_valid():
        reasons = "; ".join(f"{field}: {' '.join(errors)}" for field, errors in form.errors.items())
        return _problem(request, f"these filters cannot be used: {reasons}")
    entries = audit_log.filtered_entries(**{name: value for name, value in form.cleaned_data.items() if value})
    newer = list(entries.filter(pk__gt=int(after))[: audit_log.PAGE_SIZE])
    if not newer:
        return HttpResponse(status=204)
    newest = max(entry.pk for entry in newer)
    context = {"entries": newer, "poll": audit_log.poll_url(request.GET, newest=newest), "poll_s": audit_log.POLL_S}
    return render(request, "dashboard/partials/audit_newer.html", context)


def _row(change: audit_summary.Change) -> dict[str, str]:
    return {
        "path": change.path,
        "before": audit_summary.show(change.before),
        "after": audit_summary.show(change.after),
    }


def _problem(request: HttpRequest, message: str) -> HttpResponse:
    # Swapped in at the top of the list all the same (base.html's htmx config swaps a 400): the reader sees it.
    return render(request, "dashboard/partials/audit_problem.html", {"problem": message}, status=400)
