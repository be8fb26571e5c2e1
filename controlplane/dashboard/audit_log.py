"""The audit log page's query: the entries the filters select, newest first, a page at a time."""

from django.core.paginator import Page, Paginator
from django.db.models import Q, QuerySet
from django.http import QueryDict
from django.urls import reverse

from controlplane.audit.models import AuditEntry

PAGE_SIZE = 50
#: How often the log's first page asks for newer entries (seconds).
POLL_S = 5


def target_types() -> list[str]:
    """The kinds of record the log has entries about (for the filter's choices)."""
    return sorted(AuditEntry.objects.order_by().values_list("target_type", flat=True).distinct())


def filtered_entries(
    *, actor: str = "", action: str = "", target_type: str = "", target: str = ""
) -> QuerySet[AuditEntry]:
    """Entries by ``actor`` (exact), whose action starts with ``action`` (``pipeline.`` or ``pipeline.scale``),
    about records of ``target_type`` whose id is ``target`` or whose name contains it; empty: any."""
    entries = AuditEntry.objects.order_by("-created_at", "-id")
    if actor:
        entries = entries.filter(actor_name=actor)
    if action:
        entries = entries.filter(action__startswith=action)
    if target_type:
        entries = entries.filter(target_type=target_type)
    if target:
        entries = entries.filter(Q(target_id=target) | Q(target_name__icontains=target))
    return entries


def page_of(entries: QuerySet[AuditEntry], number: str | None) -> Page[AuditEntry]:
    """Page ``number`` (1 when it is missing or not a number; the last when it is past the end)."""
    return Paginator(entries, PAGE_SIZE).get_page(number)


def filters_of(query: QueryDict) -> QueryDict:
    """The filters of a request to the log: its query without the page and the poll's ``after``."""
    filters = query.copy()
    for name in ("page", "after"):
        filters.pop(name, None)
    return filters


def poll_url(query: QueryDict, *, newest: int) -> str:
    """The URL that asks for the entries newer than ``newest`` (an entry's id; 0: any) with ``query``'s
    filters."""
    filters = filters_of(query)
    filters["after"] = str(newest)
    return f"{reverse('dashboard:audit-newer')}?{filters.urlencode()}"
