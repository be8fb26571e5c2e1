"""The Requests page (the request log: newest first, filtered, a page at a time, polled for new rows) and a
request's detail (the router's decision). The pipeline page's router view reads controlplane/traffic/queries.py.

Bad filter input is the form's error, answered 400 with the page: never a 500, never a silently ignored filter.
"""

from typing import Any

from django import forms
from django.core.paginator import Page, Paginator
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from controlplane.dashboard.access import ACT_ROLE, role_required
from controlplane.dashboard.views import render_page
from controlplane.traffic.models import NAME_LENGTH, RequestRecord

PAGE_SIZE = 50
#: How often the page asks for new rows (seconds).
POLL_S = 3


class RequestFilterForm(forms.Form):
    """The Requests page's filters; empty ones select everything."""

    STATUS_CLASSES = (("", "any status"), ("2xx", "2xx"), ("4xx", "4xx"), ("5xx", "5xx"), ("failed", "failed"))

    model = forms.CharField(required=False, max_length=NAME_LENGTH)
    key = forms.IntegerField(required=False, min_value=1, label="API key id")
    status = forms.ChoiceField(required=False, choices=STATUS_CLASSES)
    worker = forms.CharField(required=False, max_length=16, label="Worker (hex id)")
    q = forms.CharField(required=False, max_length=NAME_LENGTH, label="Request id")

    def clean_worker(self) -> int | None:
        text = self.cleaned_data["worker"].strip().lower().removeprefix("0x")
        if not text:
            return None
        try:
            return int(text, 16)
        except ValueError:
            raise forms.ValidationError("a worker's id is hexadecimal, as the pipeline page shows it") from None


def filtered_records(filters: dict[str, Any]) -> QuerySet[RequestRecord]:
    """The records the (cleaned) filters select, newest first."""
    records = RequestRecord.objects.select_related("pipeline", "instance").order_by("-at", "-pk")
    if filters.get("model"):
        records = records.filter(model=filters["model"])
    if filters.get("key") is not None:
        records = records.filter(api_key_id=filters["key"])
    if filters.get("worker") is not None:
        records = records.filter(endpoint_instance_id=filters["worker"])
    if filters.get("q"):
        records = records.filter(request_id__icontains=filters["q"])
    status = filters.get("status")
    if status == "2xx":
        records = records.filter(status__lt=300, error="")
    elif status == "4xx":
        records = records.filter(status__gte=400, status__lt=500)
    elif status == "5xx":
        records = records.filter(status__gte=500)
    elif status == "failed":
        records = records.filter(Q(status__gte=400) | ~Q(error=""))
    return records


def page_of(records: QuerySet[RequestRecord], number: str | None) -> Page[RequestRecord]:
    """Page ``number`` (1 when missing or not a number; the last when past the end)."""
    return Paginator(records, PAGE_SIZE).get_page(number)


def _context(request: HttpRequest) -> tuple[dict[str, Any], int]:
    form = RequestFilterForm(request.GET or None)
    if form.is_bound and not form.is_valid():
        return {"form": form, "page": None, "query": "", "poll_s": POLL_S}, 400
    filters = form.cleaned_data if form.is_bound else {}
    page = page_of(filtered_records(filters), request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return {"form": form, "page": page, "query": query.urlencode(), "poll_s": POLL_S}, 200


@role_required(ACT_ROLE)
@require_GET
def requests_page(request: HttpRequest) -> HttpResponse:
    """The request log, filtered; its first page polls for new rows."""
    context, status = _context(request)
    return render_page(request, "dashboard/requests.html", context, status=status)


@role_required(ACT_ROLE)
@require_GET
def request_rows(request: HttpRequest) -> HttpResponse:
    """The rows of the Requests page for the same filters (what its poll swaps in)."""
    context, status = _context(request)
    return render(request, "dashboard/partials/request_rows.html", context, status=status)


@role_required(ACT_ROLE)
@require_GET
def request_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One request: its figures and the router's decision."""
    record = get_object_or_404(RequestRecord.objects.select_related("pipeline", "instance"), pk=pk)
    return render_page(request, "dashboard/request.html", {"record": record})
