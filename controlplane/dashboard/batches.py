"""The Batches page: the OpenAI batches of the person's keys (an admin's: everyone's), newest first, each with
its progress, refreshed every two seconds while one is running (htmx polls the table)."""

from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

from controlplane.accounts.models import Role, User
from controlplane.batches.models import Batch
from controlplane.dashboard.access import role_required
from controlplane.dashboard.usage import visible_keys
from controlplane.dashboard.views import render_page

PAGE_SIZE = 50
REFRESH_S = 2


@role_required(Role.OPERATOR)
@require_GET
def batches_page(request: HttpRequest) -> HttpResponse:
    person = request.user
    assert isinstance(person, User)  # role_required let only people through
    rows = Batch.objects.filter(api_key__in=visible_keys(person)).select_related("api_key__owner")
    page = Paginator(rows.order_by("-created_at", "id"), PAGE_SIZE).get_page(request.GET.get("page"))
    context = {
        "page": page,
        "show_owner": person.has_role(Role.ADMIN),
        "running": any(batch.status in Batch.RUNNING for batch in page.object_list),
        "refresh_s": REFRESH_S,
    }
    if request.headers.get("HX-Request"):  # the table's own refresh
        return render_page(request, "dashboard/partials/batches_table.html", context)
    return render_page(request, "dashboard/batches.html", context)
